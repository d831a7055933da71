set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu4.log
t0=$(date +%s)
for c in causal-8x2048-hs64 causal-8x2048-hs256; do for b in fa2 fa3; do
  timeout 400 python3 experiments/bench_prefill.py --cases $c --impls flashinfer_$b --reps 1 --out /tmp/warm_$c$b.csv > $OUT/warm_$c$b.log 2>&1 &
done; done
wait
echo "warm-up: $(( $(date +%s) - t0 )) s" | tee -a $OUT/gpu4.log
du -sh ~/.cache/flashinfer 2>&1 | tee -a $OUT/gpu4.log
for f in $OUT/warm_*.log; do tail -3 $f; done | tee -a $OUT/gpu4.log
cp results/prefill_h100.csv $OUT/prefill_h100.csv
timeout $(( 570 - $(date +%s) + t0 )) python3 experiments/bench_prefill.py --cases causal-8x2048-hs64 causal-8x2048-hs256 --out $OUT/prefill_h100.csv 2>&1 | grep -v Warn | tail -20 | tee -a $OUT/gpu4.log
