#!/usr/bin/env bash
# Make the SuperLink's TLS material: a certificate authority (CA) and a server certificate valid for
# every name and IP address the SuperNodes and the `flwr` CLI will dial, plus the shared secret the
# SuperLink's executor (SuperExec) proves itself with.
#
#   bash docker/make-certs.sh OUT_DIR NAME_OR_IP [NAME_OR_IP ...]
#   bash docker/make-certs.sh docker/server/secrets superlink localhost 127.0.0.1 203.0.113.5
#
# Writes OUT_DIR/ca.crt (give it to every SuperNode machine and to the CLI's connection), ca.key (keep
# it private, ideally offline), server.pem + server.key (for the SuperLink) and superexec.secret.
# Existing files are never overwritten: delete them first to make new ones.
set -euo pipefail

usage() { echo "usage: $0 OUT_DIR NAME_OR_IP [NAME_OR_IP ...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
out=$1; shift
command -v openssl >/dev/null || { echo "$0: openssl is not installed" >&2; exit 1; }
mkdir -p "$out"
for f in ca.crt ca.key server.pem server.key; do
  if [[ -e "$out/$f" ]]; then echo "$0: $out/$f exists; remove it to make new certificates" >&2; exit 1; fi
done

# Every dialled name or address must be a subjectAltName, else TLS verification fails on the client.
sans=()
for host in "$@"; do
  if [[ $host =~ ^[0-9]+(\.[0-9]+){3}$ || $host == *:* ]]; then san="IP:$host"; else san="DNS:$host"; fi
  [[ " ${sans[*]-} " == *" $san "* ]] || sans+=("$san")  # once each, however often it is given
done
san_list=$(IFS=,; echo "${sans[*]}")
days=${CERT_DAYS:-365}

umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -sha256 -nodes -days "$days" -subj "/CN=fedssl-ca" \
  -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -sha256 -nodes -subj "/CN=$1" \
  -keyout "$out/server.key" -out "$out/server.csr" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n' \
  "$san_list" > "$out/server.ext"
openssl x509 -req -sha256 -days "$days" -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -extfile "$out/server.ext" -out "$out/server.pem" 2>/dev/null
rm -f "$out/server.csr" "$out/server.ext" "$out/ca.srl"
[[ -e "$out/superexec.secret" ]] || openssl rand -hex 32 > "$out/superexec.secret"
chmod 644 "$out/ca.crt" "$out/server.pem"
chmod 600 "$out/ca.key" "$out/server.key" "$out/superexec.secret"
echo "wrote $out/{ca.crt,ca.key,server.pem,server.key,superexec.secret} for: $san_list"
echo "for Docker: the Flower containers run as user 'app' (uid 49999), so let it read the private files:"
echo "  sudo chown 49999:49999 $out/server.key $out/superexec.secret"
