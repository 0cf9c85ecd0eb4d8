# Sourced by scripts/setup and scripts/kernel-headers: one-line messages, apt, and a log of what the
# tools printed. apt and pip write to the log, which is shown (its tail) only when a step fails, so
# a set-up that works prints memrec's own lines and nothing else.

say() { printf 'memrec setup: %s\n' "$*" >&2; }

# One log for the whole run: the first script that sources this file makes it and removes it when
# that script succeeds; a script it calls appends to the same log.
if [ -z "${MEMREC_SETUP_LOG:-}" ]; then
  MEMREC_SETUP_LOG=$(mktemp "${TMPDIR:-/tmp}/memrec-setup.XXXXXX")
  export MEMREC_SETUP_LOG
  trap 'rc=$?; [ "$rc" = 0 ] && rm -f "$MEMREC_SETUP_LOG"; exit "$rc"' EXIT
fi

# quiet CMD...: run CMD with its output in the log.
quiet() { "$@" >>"$MEMREC_SETUP_LOG" 2>&1; }

# die CODE MESSAGE: the message, the log's last lines, where the whole log is; exit CODE.
die() {
  local code=$1
  shift
  say "$*"
  if [ -s "$MEMREC_SETUP_LOG" ]; then
    tail -n 15 "$MEMREC_SETUP_LOG" | sed 's/^/  | /' >&2
    say "the whole log: $MEMREC_SETUP_LOG"
  fi
  exit "$code"
}

# installed PKG: the package is installed (not merely known, nor removed with its config left).
installed() {
  local status
  status=$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null) || return 1
  [[ $status == *" installed" ]]
}

# known PKG: apt's lists have a version of PKG (a purely virtual name does not count).
known() { [ -n "$(apt-cache madison "$1" 2>/dev/null)" ]; }

# apt_update: once per run (scripts called from setup share the flag). A host whose lists were
# never fetched knows no packages; a failed update (offline, one broken source) is not fatal: the
# install that follows says what is missing.
apt_update() {
  [ "${MEMREC_APT_UPDATED:-0}" = 1 ] && return 0
  export MEMREC_APT_UPDATED=1
  quiet apt-get update || say "apt-get update failed (going on with the package lists this host has; log: $MEMREC_SETUP_LOG)"
}

# apt_install PKG...: install, or stop with apt's own reason.
apt_install() {
  apt_update
  DEBIAN_FRONTEND=noninteractive quiet apt-get install -y "$@" || die 69 "apt-get install $* failed"
}
