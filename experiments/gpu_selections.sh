#!/usr/bin/env bash
# The gpu-profile suite split into six -k selections, each small enough for one
# 10-minute device call.  `bash experiments/gpu_selections.sh check` (on the GPU
# machine, after gpu_tests.sh's environment is set up) collects the suite and
# each selection and fails unless the six are disjoint and cover the suite.
# `bash experiments/gpu_selections.sh N` prints selection N (1..6).
set -uo pipefail
DECODE="decode and not placement and not tensor_core_variants"   # selections 1 and 2 split these
SEL=(
  "$DECODE and not dynamic_ring and (dtypefloat16 or dtypebfloat16)"
  "$DECODE and (dynamic_ring or not (dtypefloat16 or dtypebfloat16))"
  "not decode and prefill"
  "not (decode and not placement) and not prefill and not tensor_core_variants"
  "tensor_core_variants and not pv_mma"
  "tensor_core_variants and pv_mma"
)
DESELECT=tests/test_ptx.py::test_specialisations_compile_to_ptx
if [ "${1:-}" != check ]; then echo "${SEL[$(( $1 - 1 ))]}"; exit; fi
tmp=$(mktemp -d)
ids() { python3 -m pytest -p no:cacheprovider -p no:benchmark paged_numba tests --collect-only -q \
        --deselect "$DESELECT" "$@" 2>/dev/null | grep '::' | sort; }
ids > "$tmp/all"
: > "$tmp/union"
for i in 0 1 2 3 4 5; do
  ids -k "${SEL[$i]}" > "$tmp/s$i"
  echo "selection $((i + 1)): $(wc -l < "$tmp/s$i") tests: ${SEL[$i]}"
  cat "$tmp/s$i" >> "$tmp/union"
done
sort "$tmp/union" > "$tmp/u"
echo "suite: $(wc -l < "$tmp/all") tests; selections: $(wc -l < "$tmp/u") ($(sort -u "$tmp/u" | wc -l) distinct)"
cmp -s "$tmp/all" "$tmp/u" && echo "the six selections partition the suite" || { echo "NOT a partition"; exit 1; }
