#!/bin/sh
# Tokens for deploy/compose.yaml (or for any other deployment): one participant token per site
# and an admin token, as env files readable by their owner only:
#   DIR/coordinator.env  FEDTRAIN_TOKEN=<every site's token, comma-separated>, FEDTRAIN_ADMIN_TOKEN
#   DIR/<site>.env       FEDTRAIN_TOKEN=<that site's token> (never the admin token)
# Usage: sh deploy/make-secrets.sh [DIR] [SITE...]   (default: deploy/secrets site-a site-b)
# An existing DIR/coordinator.env is left as it is (the run's tokens stay the same): remove the
# directory to make new ones.
set -eu
dir=${1:-"$(dirname "$0")/secrets"}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- site-a site-b
if [ -e "$dir/coordinator.env" ]; then
  echo "make-secrets: $dir/coordinator.env exists; keeping the tokens there" >&2
  exit 0
fi
umask 077
mkdir -p "$dir"
token() { printf 'ft_%s' "$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"; }
admin=$(token)
all=""
for site in "$@"; do
  case "$site" in *[!A-Za-z0-9_.-]*|"") echo "make-secrets: bad site name: $site" >&2; exit 2;; esac
  t=$(token)
  printf 'FEDTRAIN_TOKEN=%s\n' "$t" > "$dir/$site.env"
  all=${all:+$all,}$t
done
printf 'FEDTRAIN_TOKEN=%s\nFEDTRAIN_ADMIN_TOKEN=%s\n' "$all" "$admin" > "$dir/coordinator.env"
echo "make-secrets: wrote $dir/coordinator.env and $(printf '%s.env ' "$@")(mode 600)"
