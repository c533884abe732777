# Sourced by the .ci/install_*.sh scripts: the one way they install Debian/Ubuntu packages.
#
# apt_install SCRIPT CONSEQUENCE PACKAGE...: install PACKAGEs without recommends, quietly; when the first try fails
# (stale package lists on a fresh image), update the lists once and try again. On failure it prints
# "SCRIPT: apt-get install PACKAGE... failed (CONSEQUENCE):" and apt's last lines on stderr and returns 1, so the
# caller says `apt_install ... || exit 0` (a machine that cannot install skips those tests, it does not fail CI).
apt_install() {
  local script="$1" consequence="$2" log
  shift 2
  log="$(mktemp)"
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >"$log" 2>&1 ||
     { apt-get update -q >>"$log" 2>&1 &&
       DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >>"$log" 2>&1; }; then
    rm -f "$log"
    return 0
  fi
  echo "$script: apt-get install $* failed ($consequence):" >&2
  tail -5 "$log" >&2
  rm -f "$log"
  return 1
}
