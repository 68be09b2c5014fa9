# Sourced by the gpu_*.sh scripts: the GPU's busy fraction and memory, sampled beside their runs.
# start_smi names the GPUs and writes $OUT/smi.csv every 2 s in the background (nothing where
# nvidia-smi is missing); stop_smi ends that sampler. A bare `wait` would wait for it forever.
SMI=
start_smi() {
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi -L
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 2 > "$OUT/smi.csv" &
    SMI=$!
  fi
}
stop_smi() { if [ -n "$SMI" ]; then kill "$SMI"; fi; }
