#!/usr/bin/env bash
# Create the TLS and SuperNode-authentication material for a fedskew deployment.
#
#   deploy/make-certs.sh [-o DIR] [-n NODES] [-s SANS] [-d DAYS]
#
#   -o DIR    output folder (default ./certs); existing keys are kept, so re-running is safe
#   -n NODES  number of SuperNode key pairs node0 .. node<NODES-1> (default 2)
#   -s SANS   subject alternative names of the SuperLink certificate, comma separated openssl
#             syntax (default "DNS:localhost,IP:127.0.0.1"); add the name/IP the SuperNodes and
#             the `flwr` CLI use to reach the SuperLink, e.g. "DNS:superlink.example.org,IP:10.0.0.5"
#   -d DAYS   validity of the certificates (default 365)
#
# Writes: ca.crt ca.key (the CA; keep ca.key private), superlink.pem superlink.key (the SuperLink's
# server certificate and key), node<i> node<i>.pub (OpenSSH ECDSA P-384 key pairs; the private key
# stays on SuperNode i, the .pub is registered with `flwr supernode register`).
# Needs openssl and ssh-keygen.
set -euo pipefail
OUT=certs NODES=2 SANS="DNS:localhost,IP:127.0.0.1" DAYS=365
while getopts "o:n:s:d:h" opt; do
  case $opt in
    o) OUT=$OPTARG ;; n) NODES=$OPTARG ;; s) SANS=$OPTARG ;; d) DAYS=$OPTARG ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "make-certs: openssl is required" >&2; exit 1; }
command -v ssh-keygen >/dev/null || { echo "make-certs: ssh-keygen (openssh-client) is required" >&2; exit 1; }
mkdir -p "$OUT"
cd "$OUT"
umask 077

if [ ! -f ca.key ]; then
  openssl req -x509 -new -nodes -newkey rsa:3072 -sha256 -keyout ca.key -out ca.crt -days "$DAYS" \
    -subj "/CN=fedskew-ca" -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
  echo "make-certs: created CA $OUT/ca.crt"
fi

# The SuperLink certificate is re-issued on every call, so changed SANs take effect.
CN=${SANS%%,*}; CN=${CN#*:}
cat > superlink.cnf <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = $CN
[v3]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = $SANS
CNF
openssl req -new -nodes -newkey rsa:3072 -sha256 -keyout superlink.key -out superlink.csr -config superlink.cnf 2>/dev/null
openssl x509 -req -sha256 -in superlink.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out superlink.pem \
  -days "$DAYS" -extfile superlink.cnf -extensions v3 2>/dev/null
rm -f superlink.csr
echo "make-certs: SuperLink certificate $OUT/superlink.pem for $SANS"

for ((i = 0; i < NODES; i++)); do
  if [ ! -f "node$i" ]; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedskew-node$i" -f "node$i"
    echo "make-certs: SuperNode key pair $OUT/node$i, $OUT/node$i.pub"
  fi
done
chmod 644 ca.crt superlink.pem ./*.pub
