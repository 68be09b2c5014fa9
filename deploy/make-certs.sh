#!/usr/bin/env bash
# Create the TLS and SuperNode-authentication material for a fedskew deployment.
#
#   deploy/make-certs.sh [-o DIR] [-n NODES] [-a ADMINS] [-s SANS] [-d DAYS]
#
#   -o DIR     output folder (default ./certs); existing keys are kept, so re-running is safe
#   -n NODES   number of SuperNode key pairs node0 .. node<NODES-1> (default 2)
#   -a ADMINS  comma separated names of the operators allowed to use the Control API through the
#              gateway (register nodes, submit runs): one client certificate each (default "admin")
#   -s SANS    subject alternative names of the SuperLink certificate, comma separated openssl
#              syntax: the name/IP the SuperNodes and operators use to reach the gateway, e.g.
#              "DNS:superlink.example.org,IP:10.0.0.5"; DNS:localhost,IP:127.0.0.1 are always added
#              (the gateway reaches the SuperLink on the loopback)
#   -d DAYS    validity of the certificates (default 365)
#
# Writes: ca.crt ca.key (the CA; keep ca.key private), superlink.pem superlink.key (the server
# certificate of the gateway and the SuperLink), <admin>.crt <admin>.key (an operator's client
# certificate; gives full control of the federation: keep it like a password), node<i> node<i>.pub
# (OpenSSH ECDSA P-384 key pairs; the private key stays on SuperNode i, the .pub is registered with
# `flwr supernode register`). Needs openssl and ssh-keygen.
set -euo pipefail
OUT=certs NODES=2 ADMINS=admin SANS="" DAYS=365
while getopts "o:n:a:s:d:h" opt; do
  case $opt in
    o) OUT=$OPTARG ;; n) NODES=$OPTARG ;; a) ADMINS=$OPTARG ;; s) SANS=$OPTARG ;; d) DAYS=$OPTARG ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
  esac
done
for extra in DNS:localhost IP:127.0.0.1; do
  case ",$SANS," in *",$extra,"*) ;; *) SANS="${SANS:+$SANS,}$extra" ;; esac
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

# Operators' client certificates: the gateway admits a Control API call only with one of these.
IFS=, read -ra NAMES <<<"$ADMINS"
for name in "${NAMES[@]}"; do
  [[ $name =~ ^[A-Za-z0-9_-]+$ && $name != ca && $name != superlink ]] ||
    { echo "make-certs: bad admin name '$name' (letters, digits, - and _; not ca or superlink)" >&2; exit 2; }
  if [ ! -f "$name.crt" ]; then
    openssl req -new -nodes -newkey rsa:3072 -sha256 -keyout "$name.key" -out "$name.csr" \
      -subj "/O=fedskew/OU=operator/CN=$name" 2>/dev/null
    openssl x509 -req -sha256 -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$name.crt" -days "$DAYS" \
      -extfile <(printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n') \
      2>/dev/null
    rm -f "$name.csr"
    echo "make-certs: operator client certificate $OUT/$name.crt, $OUT/$name.key"
  fi
done

for ((i = 0; i < NODES; i++)); do
  if [ ! -f "node$i" ]; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedskew-node$i" -f "node$i"
    echo "make-certs: SuperNode key pair $OUT/node$i, $OUT/node$i.pub"
  fi
done
chmod 644 ca.crt superlink.pem ./*.pub ./*.crt
