#!/bin/sh
# A private certificate authority and the coordinator's TLS certificate, signed by it.
# Usage: sh deploy/make-certs.sh HOST [EXTRA_SAN] [DIR]
#   HOST       the name participants put in --coordinator https://HOST (the certificate's name)
#   EXTRA_SAN  more names or addresses, e.g. "IP:203.0.113.7,DNS:fedtrain.internal" (optional)
#   DIR        where to write (default: ./fedtrain-certs)
# Writes DIR/ca.pem (give it to every site: --ca-cert), DIR/ca.key (keep it offline: it signs
# certificates every site trusts), DIR/server.pem and DIR/server.key (the coordinator's
# --tls-cert/--tls-key, or nginx's ssl_certificate/ssl_certificate_key). EC P-256, SHA-256;
# the CA for 10 years, the server certificate for 825 days (what browsers accept).
# Run it again on the same DIR to renew the server certificate: the CA (ca.key, ca.pem) stays.
# With a public name, a public CA (e.g. Let's Encrypt at the proxy) needs none of this, and
# participants need no --ca-cert.
set -eu
host=${1:?usage: make-certs.sh HOST [EXTRA_SAN] [DIR]}
san="DNS:$host"
if [ -n "${2:-}" ]; then san="$san,$2"; fi
dir=${3:-fedtrain-certs}
mkdir -p "$dir"
cd "$dir"
umask 077
if [ ! -e ca.key ]; then  # run again to renew the server certificate: the CA stays
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 -days 3650 \
    -subj "/CN=fedtrain CA for $host" -keyout ca.key -out ca.pem \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign"
fi
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
  -subj "/CN=$host" -keyout server.key -out server.csr
cat > server.ext <<EXT
subjectAltName = $san
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
EXT
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -sha256 -days 825 \
  -extfile server.ext -out server.pem
rm -f server.csr server.ext ca.srl
chmod 644 ca.pem server.pem
echo "make-certs: $dir/ca.pem (for every site), $dir/ca.key (keep offline), $dir/server.pem and $dir/server.key ($san)"
