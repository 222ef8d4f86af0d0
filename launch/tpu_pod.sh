#!/usr/bin/env bash
# Drives a Cloud TPU VM (one host or a pod slice) with gcloud: every host runs the same bpd command.
#
#   launch/tpu_pod.sh create               create the TPU VM
#   launch/tpu_pod.sh setup                put the repo on every worker and install it there with jax[tpu]
#   launch/tpu_pod.sh copy SRC [DEST]      copy a local file or folder into folder DEST on every worker
#   launch/tpu_pod.sh run ARGS...          launch/run_on_host.sh ARGS (= python -m bpd.main ARGS) on every worker
#   launch/tpu_pod.sh wait                 wait until the run started by `run` has ended on every worker
#   launch/tpu_pod.sh stop                 stop (SIGTERM: checkpoint, then exit) the run started by `run`
#   launch/tpu_pod.sh logs [WORKER]        follow ~/bpd.log of a worker (default 0)
#   launch/tpu_pod.sh fetch REMOTE LOCAL   copy a file or folder from worker 0 to this machine
#   launch/tpu_pod.sh status               describe the TPU VM
#   launch/tpu_pod.sh delete               delete the TPU VM
#
# Relative remote paths (copy's DEST, fetch's REMOTE) are relative to the repo on the workers, like the
# relative paths in run's ARGS. Each gcloud command is printed (to stderr) before it runs.
#
# Environment:
#   BPD_TPU_NAME, BPD_ZONE, BPD_PROJECT   required: the TPU VM's name, zone and project
#   BPD_ACCELERATOR    accelerator type for create (default v4-32: 4 hosts of 4 chips)
#   BPD_TPU_VERSION    TPU runtime for create (default tpu-ubuntu2204-base)
#   BPD_CREATE_FLAGS   more flags for create, e.g. "--spot"
#   BPD_REPO           local folder (copied) or git URL (cloned) for setup (default: this checkout)
#   BPD_REMOTE_DIR     the repo's folder on the workers, relative to home (default bpd)
#   BPD_TPU_PIP        pip arguments setup installs besides the package (default: jax[tpu] and libtpu's index)
#   BPD_BUCKET         optional: setup mounts this GCS bucket with gcsfuse at ~/bpd-runs on every worker.
#                      Multi-host checkpoints need a folder all hosts share: then use workdirs in ../bpd-runs/.
#   BPD_FOREGROUND     1: run waits for all workers and shows their output; otherwise it starts them with nohup,
#                      writing ~/bpd.log on each worker, and returns
set -euo pipefail

launch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BPD_ACCELERATOR=${BPD_ACCELERATOR:-v4-32}
BPD_TPU_VERSION=${BPD_TPU_VERSION:-tpu-ubuntu2204-base}
BPD_REPO=${BPD_REPO:-$(dirname "$launch_dir")}
BPD_REMOTE_DIR=${BPD_REMOTE_DIR:-bpd}
BPD_TPU_PIP=${BPD_TPU_PIP:-jax[tpu] -f https://storage.googleapis.com/jax-releases/libtpu_releases.html}

usage() {
  sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p;}' "${BASH_SOURCE[0]}" >&2
  exit 2
}

die() {
  echo "tpu_pod.sh: $*" >&2
  exit 1
}

require_env() {
  local name
  for name in "$@"; do
    if [[ -z "${!name:-}" ]]; then
      die "the environment variable $name is not set; e.g. export $name=... (see launch/tpu_pod.sh's header)"
    fi
  done
}

# Quotes arguments for a shell on the other side: remote commands are strings that bash parses again.
quote() {
  printf '%q ' "$@" | sed 's/ $//'
}

gcloud_tpu() {
  local cmd=(gcloud compute tpus tpu-vm "$@" --zone="$BPD_ZONE" --project="$BPD_PROJECT")
  echo "+ $(quote "${cmd[@]}")" >&2
  "${cmd[@]}"
}

on_all_workers() {
  gcloud_tpu ssh "$BPD_TPU_NAME" --worker=all --command="$1"
}

remote_path() {
  if [[ "$1" == /* ]]; then
    echo "$1"
  else
    echo "$BPD_REMOTE_DIR/$1"
  fi
}

cmd_create() {
  local extra
  read -ra extra <<< "${BPD_CREATE_FLAGS:-}"
  # ${a[@]+"${a[@]}"}: an empty array is "unbound" to `set -u` in bash 3.2 (macOS).
  gcloud_tpu create "$BPD_TPU_NAME" --accelerator-type="$BPD_ACCELERATOR" --version="$BPD_TPU_VERSION" \
    ${extra[@]+"${extra[@]}"}
}

cmd_setup() {
  local dir get_repo mount=true
  dir=$(quote "$BPD_REMOTE_DIR")
  if [[ -d "$BPD_REPO" ]]; then
    # A tarball rather than `scp --recurse` of the folder: it leaves out .git, virtual environments and runs.
    local tarball
    tmp_dir=$(mktemp -d)  # global: the EXIT trap runs after this function has returned
    trap 'rm -rf "$tmp_dir"' EXIT
    tarball="$tmp_dir/bpd-repo.tar.gz"
    echo "+ tar -czf $tarball -C $BPD_REPO ." >&2
    # COPYFILE_DISABLE: macOS tar would otherwise add ._* metadata files.
    COPYFILE_DISABLE=1 tar -czf "$tarball" -C "$BPD_REPO" \
      --exclude=.git --exclude=__pycache__ --exclude='*.egg-info' --exclude=.pytest_cache \
      --exclude=.hypothesis --exclude=./venv --exclude=./.venv --exclude=./.ci/venv --exclude=./build \
      --exclude=./runs --exclude=./workdirs .
    gcloud_tpu scp "$tarball" "$BPD_TPU_NAME:bpd-repo.tar.gz" --worker=all
    # Unpacked over an earlier copy: runs inside it survive; files deleted locally stay there.
    get_repo="mkdir -p $dir && tar -xzf bpd-repo.tar.gz -C $dir && rm bpd-repo.tar.gz"
  else
    local url
    url=$(quote "$BPD_REPO")
    get_repo="if [ -d $dir/.git ]; then git -C $dir pull --ff-only; else git clone $url $dir; fi"
  fi
  if [[ -n "${BPD_BUCKET:-}" ]]; then
    # gcsfuse from Google's apt repository. Directory renames (orbax's atomic checkpoint commit) need
    # --rename-dir-limit on a bucket without hierarchical namespace.
    local apt_source="deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt"
    mount="if ! command -v gcsfuse > /dev/null; then
      echo \"$apt_source gcsfuse-\$(lsb_release -cs) main\" |
        sudo tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null
      curl -fsS https://packages.cloud.google.com/apt/doc/apt-key.gpg |
        sudo tee /usr/share/keyrings/cloud.google.asc > /dev/null
      sudo apt-get -qq update && sudo apt-get -qq install -y gcsfuse
    fi
    mkdir -p ~/bpd-runs
    mountpoint -q ~/bpd-runs ||
      gcsfuse --implicit-dirs --rename-dir-limit=1000000 $(quote "$BPD_BUCKET") ~/bpd-runs"
  fi
  local venv_tools="python3 -c 'import ensurepip' 2> /dev/null ||
    { sudo apt-get -qq update && sudo apt-get -qq install -y python3-venv; }"
  local install="BPD_PIP_EXTRA=$(quote "$BPD_TPU_PIP") BPD_INSTALL_ONLY=1 $dir/launch/run_on_host.sh"
  on_all_workers "set -e
    $venv_tools
    $get_repo
    $mount
    $install"
}

cmd_copy() {
  [[ $# -ge 1 && $# -le 2 ]] || die "usage: tpu_pod.sh copy SRC [DEST]"
  local dest
  dest=$(remote_path "${2:-.}")
  on_all_workers "mkdir -p $(quote "$dest")"
  gcloud_tpu scp --recurse "$1" "$BPD_TPU_NAME:$dest/" --worker=all
}

cmd_run() {
  [[ $# -ge 1 ]] || die "usage: tpu_pod.sh run --config=configs/NAME.py --workdir=DIR [--mode=M] [--config.X=Y]"
  # Every worker joins jax.distributed; on a single-host TPU VM that is a group of one.
  local launch busy
  launch="launch/run_on_host.sh $(quote "$@")"
  busy="if [ -f ~/bpd.pid ] && kill -0 \$(cat ~/bpd.pid) 2> /dev/null; then
    echo \"\$(hostname): a run is still going (pid \$(cat ~/bpd.pid)); see tpu_pod.sh logs or stop\" >&2
    exit 1
  fi"
  if [[ "${BPD_FOREGROUND:-0}" == 1 ]]; then
    on_all_workers "$busy
    cd $(quote "$BPD_REMOTE_DIR") || exit 1
    export BPD_MULTIHOST=1
    $launch"
  else
    # nohup's pid is the run's, since run_on_host.sh execs python: `stop` kills it by that pid. No stdin, so
    # that ssh returns at once.
    on_all_workers "$busy
    cd $(quote "$BPD_REMOTE_DIR") || exit 1
    export BPD_MULTIHOST=1
    nohup $launch > ~/bpd.log 2>&1 < /dev/null &
    echo \$! > ~/bpd.pid"
  fi
}

cmd_wait() {
  # Polls rather than holding a pipe to the run: a dropped connection leaves the run alone; wait again.
  on_all_workers 'while [ -f ~/bpd.pid ] && kill -0 "$(cat ~/bpd.pid)" 2> /dev/null; do sleep 30; done
    echo "$(hostname): no run going; the end of ~/bpd.log:"
    tail -n 3 ~/bpd.log 2> /dev/null || true'
}

cmd_stop() {
  on_all_workers 'if [ -f ~/bpd.pid ]; then kill "$(cat ~/bpd.pid)" 2> /dev/null || true; rm -f ~/bpd.pid; fi'
}

cmd_logs() {
  gcloud_tpu ssh "$BPD_TPU_NAME" --worker="${1:-0}" --command='tail -n 200 -F ~/bpd.log'
}

cmd_fetch() {
  [[ $# -eq 2 ]] || die "usage: tpu_pod.sh fetch REMOTE LOCAL"
  mkdir -p "$(dirname "$2")"
  gcloud_tpu scp --recurse "$BPD_TPU_NAME:$(remote_path "$1")" "$2" --worker=0
}

cmd_status() {
  gcloud_tpu describe "$BPD_TPU_NAME"
}

cmd_delete() {
  gcloud_tpu delete "$BPD_TPU_NAME" --quiet
}

main() {
  [[ $# -ge 1 ]] || usage
  local sub=$1
  shift
  case "$sub" in
    create | setup | copy | run | wait | stop | logs | fetch | status | delete) ;;
    -h | --help | help) usage ;;
    *) echo "tpu_pod.sh: unknown subcommand '$sub'" >&2; usage ;;
  esac
  require_env BPD_TPU_NAME BPD_ZONE BPD_PROJECT
  "cmd_$sub" "$@"
}

main "$@"
