set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu5.log
t0=$(date +%s)
for c in causal-8x2048-hs64 causal-8x2048-hs256; do for b in fa2 fa3; do
  timeout 540 python3 experiments/bench_prefill.py --cases $c --impls flashinfer_$b --reps 1 --out /tmp/warm_$c$b.csv > $OUT/warm_$c$b.log 2>&1 &
done; done
HYPOTHESIS_PROFILE=gpu timeout -s INT 120 python3 -m pytest -p no:cacheprovider -q -rf -n 3 tests/test_prefill_wgmma.py -k "split_rings" > $OUT/pytest5.log 2>&1
tail -4 $OUT/pytest5.log | tee -a $OUT/gpu5.log
timeout 200 python3 experiments/tune_prefill.py --head-size 256 --case causal-8x2048 causal-2x8192 --variants default w8n64-fx-wg-ws-sw-s2-pp-ps-ll-lz-sr w8n64-fx-wg-ws-sw-s2-pp-ps-ll-lz-sr-pg40 --rounds 2 2>&1 | grep -v Warn | tail -12 | tee -a $OUT/gpu5.log
timeout 170 python3 experiments/tune_prefill.py --case causal-8x2048 causal-2x8192 --variants default w8n128-fx-wg-ws-sw-s2-pp-ps-ll-sr w8n128-fx-wg-ws-sw-s2-pp-ps-ll-sr-pg40 --rounds 1 2>&1 | grep -v Warn | tail -8 | tee -a $OUT/gpu5.log
echo "at $(( $(date +%s) - t0 )) s: waiting for the FlashInfer builds" | tee -a $OUT/gpu5.log
wait
echo "warm-up done at $(( $(date +%s) - t0 )) s" | tee -a $OUT/gpu5.log
du -sh ~/.cache/flashinfer 2>&1 | tee -a $OUT/gpu5.log
for f in $OUT/warm_*.log; do echo "== $f"; tail -3 $f; done | tee -a $OUT/gpu5.log
