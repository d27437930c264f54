#!/usr/bin/env bash
# Installs the libtpu wheel into .tpu-compiler/ (not into the environment) so
# the TPU Pallas kernel can be compiled deviceless (no TPU needed) in the
# lowering tests, which put that folder on the path of their own subprocess.
# Kept out of the environment because, once importable, every JAX process on
# a machine without a TPU probes for one (slow, and an error message each
# time). Takes the libtpu version the installed jax's "tpu" extra pins, else
# (a jax with no pin) the newest. Never fails the caller: without libtpu
# those tests skip.
cd "$(dirname "$0")/.."
target=.tpu-compiler
if [ -d "$target/libtpu" ]; then
  echo "install_tpu_compiler: $target already has libtpu"
  exit 0
fi
# jax's pin is the libtpu it compiles against (a newer libtpu fails the
# sharded compiles with internal errors): a python without jax would fall
# back to the newest, so that is refused.
if ! python -c "import jax" 2>/dev/null; then
  echo "install_tpu_compiler: $(command -v python) cannot import jax; run this inside the" \
       "project's environment (TPU compile tests will be skipped)" >&2
  exit 0
fi
spec=$(python - <<'PY' 2>/dev/null
from importlib.metadata import requires
for r in requires("jax") or []:
    if r.startswith("libtpu") and 'extra == "tpu"' in r:
        print(r.split(";")[0].replace(" ", ""))
        break
PY
)
for want in ${spec:+"$spec"} libtpu; do
  if python -m pip install -q --no-deps --target "$target" "$want"; then
    echo "install_tpu_compiler: installed $want into $target"
    exit 0
  fi
done
echo "install_tpu_compiler: could not install libtpu; TPU compile tests will be skipped" >&2
exit 0
