#!/usr/bin/env bash
# Install a SLURM (slurm-wlm) and munge from Debian for tests/training/test_slurm.py.
# Idempotent: does nothing when the daemons and clients are already installed.
# Installing starts no daemon; megatron_ext/testing/slurm.py starts (and stops) its own.
set -euo pipefail

need=(slurmctld slurmd sbatch srun scontrol sinfo munged)
missing=()
for cmd in "${need[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$cmd")
done
if [ ${#missing[@]} -eq 0 ] && [ -f /etc/munge/munge.key ]; then
    echo "install_slurm: slurm-wlm and munge already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_slurm: need root or sudo" >&2; exit 1; }
    SUDO="sudo"
fi
echo "install_slurm: installing slurm-wlm and munge (missing: ${missing[*]:-munge.key})"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends slurm-wlm munge
if [ ! -f /etc/munge/munge.key ]; then  # normally created by the package
    if command -v mungekey >/dev/null 2>&1; then
        $SUDO mungekey --create --keyfile=/etc/munge/munge.key
    else
        $SUDO /usr/sbin/create-munge-key -f
    fi
    $SUDO chown munge:munge /etc/munge/munge.key
    $SUDO chmod 0400 /etc/munge/munge.key
fi
for cmd in "${need[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || {
        echo "install_slurm: $cmd still missing after install" >&2; exit 1; }
done
echo "install_slurm: done ($(dpkg-query -W -f='${Package} ${Version}' slurm-wlm 2>/dev/null))"
