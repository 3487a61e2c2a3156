#!/usr/bin/env bash
# Make one SuperNode's identity: an ECDSA P-384 key pair for SuperNode authentication, plus the secret
# its ClientApp executor (SuperExec) proves itself with to the SuperNode.
#
#   bash docker/make-supernode-key.sh OUT_DIR
#
# Writes OUT_DIR/supernode.key (private: never leaves this machine), OUT_DIR/supernode.key.pub (send it
# to whoever runs the SuperLink; they register it with `flwr supernode register supernode.key.pub <conn>`)
# and OUT_DIR/superexec.secret. Existing files are never overwritten.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
out=$1
command -v ssh-keygen >/dev/null || { echo "$0: ssh-keygen (OpenSSH client) is not installed" >&2; exit 1; }
mkdir -p "$out"
if [[ -e "$out/supernode.key" ]]; then echo "$0: $out/supernode.key exists; remove it to make a new key" >&2; exit 1; fi
ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedssl-supernode" -f "$out/supernode.key"
[[ -e "$out/superexec.secret" ]] || (umask 077; openssl rand -hex 32 > "$out/superexec.secret")
chmod 600 "$out/supernode.key" "$out/superexec.secret"
echo "wrote $out/supernode.key, $out/supernode.key.pub (register this one) and $out/superexec.secret"
echo "for Docker: the Flower containers run as user 'app' (uid 49999), so let it read the private files:"
echo "  sudo chown 49999:49999 $out/supernode.key $out/superexec.secret"
