# Source on the GPU host, from the repo root (with .whl/ beside it), before using sglang:
#     source tools/gpu/install_on_device.sh || exit 1
# Installs the staged wheels into /tmp/site (the image's own packages stay as they
# are), applies the transformers-5.17 compatibility patch to sglang, and exports the
# environment sglang needs (PYTHONPATH, CUDA_HOME, JIT cache dirs).
_t0=$(date +%s)
_REPO=$(pwd)
export SITE=${SITE:-/tmp/site}
if [ ! -f "$SITE/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$_REPO"/.whl/*.whl > /tmp/pip_install.log 2>&1 \
    || { cat /tmp/pip_install.log; echo "install_on_device: pip install failed"; return 1; }
  python3 "$_REPO/tools/gpu/patch_sglang.py" "$SITE" || { echo "install_on_device: patch failed"; return 1; }
  touch "$SITE/.installed"
fi
# stubs/ holds IPython (not in the image; only notebook helpers use it)
export PYTHONPATH="$SITE:$_REPO/tools/gpu/stubs${PYTHONPATH:+:$PYTHONPATH}"

# nvcc / CUDA_HOME for sglang's tvm-ffi JIT kernels (rope, norm, activation, kv store)
if [ -z "${CUDA_HOME:-}" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
  fi
fi
[ -n "${CUDA_HOME:-}" ] && export PATH="$CUDA_HOME/bin:$PATH"
# tvm-ffi's JIT runs `ninja` from PATH; the image has the pip package
if ! command -v ninja >/dev/null 2>&1; then
  _nb=$(python3 -c 'import ninja, os; print(ninja.BIN_DIR)' 2>/dev/null) && [ -x "$_nb/ninja" ] && export PATH="$_nb:$PATH"
fi
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/jitcache/tvm-ffi}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/jitcache/triton}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/jitcache/flashinfer}
mkdir -p "$TVM_FFI_CACHE_DIR" "$TRITON_CACHE_DIR" "$FLASHINFER_WORKSPACE_BASE"
# A JIT cache tarball brought back from an earlier run (optional) saves compile time.
if [ -f "$_REPO/.gpu-out/jitcache.tgz" ] && [ ! -f /tmp/jitcache/.restored ]; then
  tar -xzf "$_REPO/.gpu-out/jitcache.tgz" -C / && touch /tmp/jitcache/.restored && echo "install_on_device: JIT cache restored"
fi
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# headless host: plots are written to files (pyplot would otherwise probe the IPython stub)
export MPLBACKEND=${MPLBACKEND:-Agg}
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false

echo "install_on_device: site=$SITE CUDA_HOME=${CUDA_HOME:-<none>} ($(( $(date +%s) - _t0 ))s)"
echo "install_on_device: nvcc=$(command -v nvcc || echo MISSING) c++=$(command -v c++ || echo MISSING) g++=$(command -v g++ || echo MISSING) ninja=$(command -v ninja || echo MISSING)"
python3 - <<'EOF'
import importlib.metadata as md, sys
def v(n):
    try: return md.version(n)
    except Exception: return "-"
import torch
print("install_on_device: python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
print("install_on_device:", ", ".join(f"{n} {v(n)}" for n in
      ["sglang", "sglang-kernel", "flashinfer-python", "apache-tvm-ffi", "torch-memory-saver", "xgrammar",
       "transformers", "triton", "pydantic", "fastapi", "starlette", "uvicorn"]))
EOF
