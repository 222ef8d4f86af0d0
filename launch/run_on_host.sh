#!/usr/bin/env bash
# Runs `python -m bpd.main ARGS` on this host, after making sure the package is installed.
#
# On a pod every host runs this same command at once (launch/tpu_pod.sh run does that).
#   launch/run_on_host.sh --config=configs/multi30k_ende.py --workdir=runs/base --mode=train
# Works from any directory: it first changes to the repo root, so relative paths in ARGS (the config file,
# --workdir, the configs' ../shared/data/...) are relative to the repo root.
#
# Environment:
#   BPD_VENV          virtual environment, created if missing (default: ~/bpd-venv)
#   BPD_SKIP_INSTALL  1: create nothing, install nothing; use BPD_VENV if it exists, else python on PATH
#   BPD_PIP_EXTRA     more pip arguments for the install, e.g. "jax[tpu]" (launch/tpu_pod.sh setup sets it)
#   BPD_INSTALL_ONLY  1: install, then exit without running bpd.main
#   BPD_PYTHON        the interpreter that runs bpd.main (default: python of the venv or PATH)
#   BPD_MULTIHOST     set to 1 here when TPU_WORKER_ID / CLOUD_TPU_TASK_ID is set or ARGS hold --multihost;
#                     bpd.main then calls jax.distributed.initialize()
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

venv=${BPD_VENV:-$HOME/bpd-venv}
if [[ "${BPD_SKIP_INSTALL:-0}" != 1 ]]; then
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "run_on_host: creating the virtual environment $venv" >&2
    if ! python3 -m venv "$venv"; then
      echo "run_on_host: 'python3 -m venv' failed; install it with: sudo apt-get install -y python3-venv" >&2
      exit 1
    fi
  fi
  # The install is editable, so code changes need no reinstall: install again only when setup.py or the
  # extra pip arguments change. The stamp file remembers what was installed.
  stamp="$venv/.bpd-installed"
  wanted="$repo ${BPD_PIP_EXTRA:-}"
  if [[ ! -f "$stamp" || setup.py -nt "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
    # read -a splits on spaces without expanding globs, so "jax[tpu]" stays one literal argument.
    # ${a[@]+"${a[@]}"}: an empty array is "unbound" to `set -u` in bash 3.2 (macOS).
    read -ra pip_extra <<< "${BPD_PIP_EXTRA:-}"
    echo "run_on_host: pip install -e . ${pip_extra[*]}" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e . ${pip_extra[@]+"${pip_extra[@]}"}
    echo "$wanted" > "$stamp"
  fi
fi
if [[ "${BPD_INSTALL_ONLY:-0}" == 1 ]]; then
  exit 0
fi

# Activating a venv amounts to putting its bin/ first on PATH; sourcing bin/activate is not `set -u` safe.
if [[ -x "$venv/bin/python" ]]; then
  export VIRTUAL_ENV=$venv
  export PATH="$venv/bin:$PATH"
fi
python=${BPD_PYTHON:-python}
if [[ -z "${BPD_PYTHON:-}" ]] && ! command -v python > /dev/null; then
  python=python3  # Ubuntu without a venv has only python3.
fi

# A pod host must join the others through jax.distributed.initialize(). An explicit BPD_MULTIHOST wins.
if [[ -z "${BPD_MULTIHOST:-}" ]]; then
  if [[ -n "${TPU_WORKER_ID:-}" || -n "${CLOUD_TPU_TASK_ID:-}" ]]; then
    export BPD_MULTIHOST=1
  fi
  for arg in "$@"; do
    case "$arg" in
      --multihost | --multihost=true | --multihost=True | --multihost=1) export BPD_MULTIHOST=1 ;;
    esac
  done
fi

echo "run_on_host: $(hostname) worker=${TPU_WORKER_ID:-${CLOUD_TPU_TASK_ID:-?}}" \
  "BPD_MULTIHOST=${BPD_MULTIHOST:-0}: $python -m bpd.main $*" >&2
exec "$python" -m bpd.main "$@"
