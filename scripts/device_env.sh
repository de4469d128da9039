# Source at the start of every GPU-machine command (carry .whl for jax-triton):
#   . scripts/device_env.sh
# The image has jax, flax, orbax, torch, transformers, triton; jspec runs from the checkout.
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  >/tmp/pip.log 2>&1 || cat /tmp/pip.log
export PYTHONPATH="$PWD:/tmp/site"
mkdir -p "${OUT:-/tmp/out}"
# The device copy has no ../shared: the prompt sets travel as out/prompts (carry it).
if [ -z "${JSPEC_PROMPTS_DIR:-}" ] && [ -f out/prompts/humaneval.jsonl ]; then
  export JSPEC_PROMPTS_DIR=$PWD/out/prompts
fi
python3 -c "import jax, jspec.kernels, jspec.convert; print('jax', jax.__version__, jax.devices())"
