# Sourced by the A/B scripts (engine_ops_ab.sh, overload_ab.sh): `baseline_site REV DIR` builds REV into a
# wheel (`coalesce.loadtests.gpu.bundle baseline`, a temporary worktree) and installs it into DIR/site,
# which goes first on PYTHONPATH for the baseline's runs (the way kernels/gpu_ab.sh serves a baseline on
# the GPU machine). PYTHON: the interpreter (default .venv/bin/python).
baseline_site() {
    local rev=$1 dir=$2 py=${PYTHON:-.venv/bin/python}
    "$py" -m coalesce.loadtests.gpu.bundle baseline "$dir" "$rev" > /dev/null
    "$py" -m pip install -q --no-deps --no-compile --target "$dir/site" "$dir"/base/coalesce-*.whl
}
