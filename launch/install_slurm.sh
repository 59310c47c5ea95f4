#!/usr/bin/env bash
# Install the Debian Slurm packages that launch/slurm_local.sh runs (Debian 12: Slurm 22.05).
#
#   launch/install_slurm.sh                     # slurmctld slurmd slurm-client
#   launch/install_slurm.sh --with-accounting   # + slurmdbd mariadb-server (real sacct)
#
# Idempotent: packages already installed are skipped, so CI can call it every run.
# Needs root (apt-get). Starts no daemon: the packages' init scripts do nothing without
# systemd, and slurm_local.sh starts its own daemons with its own slurm.conf.
set -euo pipefail

packages=(slurmctld slurmd slurm-client)
if [[ "${1:-}" == "--with-accounting" ]]; then
    packages+=(slurmdbd mariadb-server)
elif [[ $# -gt 0 ]]; then
    echo "usage: $0 [--with-accounting]" >&2
    exit 2
fi

missing=()
for pkg in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "slurm: already installed (${packages[*]})"
    exit 0
fi

if [[ $EUID -ne 0 ]]; then
    echo "slurm: installing ${missing[*]} needs root" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# policy-rc.d exit 101 keeps maintainer scripts from trying to start daemons (no init system here).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    created_policy=1
fi
remove_policy() { if ((created_policy)); then rm -f "$policy"; fi; }
trap remove_policy EXIT

apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "slurm: installed ${missing[*]} ($(slurmd -V))"
