#!/usr/bin/env bash
# On the GPU host, from the repo root, with .whl-ray/ carried (tools/gpu/stage_ray.sh made it):
#     bash tools/gpu/install_ray_on_device.sh
# Installs ray (and jsonschema with its dependencies, which ray core imports) into /tmp/site-ray
# (kept while the machine stays warm) and checks that a local Ray sees the GPU; only a passing check
# marks the install done. A later call adds it with: export PYTHONPATH=/tmp/site-ray:$PYTHONPATH
set -euo pipefail
SITE_RAY=${SITE_RAY:-/tmp/site-ray}
if [ ! -f "$SITE_RAY/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE_RAY" .whl-ray/*.whl
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH="$SITE_RAY${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'EOF'
import ray
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
print("ray", ray.__version__, "resources:", ray.cluster_resources())

@ray.remote(num_gpus=0.5)
def visible():
    import os
    return os.environ.get("CUDA_VISIBLE_DEVICES")

print("CUDA_VISIBLE_DEVICES in a 0.5-GPU task:", ray.get(visible.remote()))
ray.shutdown()
EOF
touch "$SITE_RAY/.installed"
echo "ray installed in $SITE_RAY; in the next call (same warm machine): export PYTHONPATH=$SITE_RAY:\$PYTHONPATH"
