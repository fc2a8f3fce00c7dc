#!/usr/bin/env bash
# Installs, idempotently, everything ckpt needs from the system (Debian 12 or 13, as root):
#   - CRIU >= 4.2 whose `criu check` passes: the distribution's package when it is new enough and
#     works, otherwise built from Debian testing's source package into /usr/local. 4.2 and not
#     4.0: on Linux >= 6.16 older CRIUs fail to dump any TCP/UDP socket (getsockopt SO_PASSCRED
#     now returns EOPNOTSUPP on inet sockets; fixed upstream in 4.2). Debian 13 ships 4.1.1.
#   - the CRIU source tree matching that version, with lib/pycriu generated, so that pycriu
#     (not on PyPI) can be installed into the project's virtualenv;
#   - nftables (the network lock for established TCP connections; iptables is absent here).
# Prints the path of the CRIU source tree's lib/ directory on its last line of stdout.
set -euo pipefail

MIN_VERSION=4.2
SRC_BASE=${CKPT_CRIU_SRC_BASE:-/usr/local/src/ckpt-criu}
SOURCES_FILE=/etc/apt/sources.list.d/ckpt-criu-src.sources

log() { echo "install-criu: $*" >&2; }
die() { echo "install-criu: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (CRIU needs root; try: sudo make setup)"
command -v apt-get >/dev/null || die "this script supports Debian-based systems with apt-get only"

# shellcheck disable=SC1091
. /etc/os-release
codename=${VERSION_CODENAME:?cannot read VERSION_CODENAME from /etc/os-release}

# Runtime and build dependencies. The build ones are needed even when the distribution's
# CRIU is used, because pycriu's protobuf modules are generated from the CRIU source tree;
# libxxhash-dev (xxhash.h) for ckpt's page hashing in C (ckpt/_pagehash.c); socat: the shell
# examples and tests of `ckpt run`'s CKPT_SOCKET protocol (docs/api.md, test_agent_socket.py).
PACKAGES=(
  nftables libnftables1 libprotobuf-c1 libnl-3-200 libnet1 libcap2 libbsd0 libuuid1
  build-essential pkgconf protobuf-compiler protobuf-c-compiler libprotobuf-dev libprotobuf-c-dev
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev uuid-dev libnftables-dev xz-utils dpkg-dev
  python3 python3-venv python3-dev libxxhash-dev iproute2 procps cron socat
)

apt_updated=0
apt_update_once() {
  if [ "$apt_updated" = 0 ]; then
    log "apt-get update"
    apt-get update -qq >&2
    apt_updated=1
  fi
}

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  apt_update_once
  log "installing: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

criu_version() { "$1" --version 2>/dev/null | sed -n 's/^Version: \(.*\)/\1/p'; }
criu_works() {
  local bin=$1 version
  [ -x "$bin" ] || return 1
  version=$(criu_version "$bin")
  [ -n "$version" ] && dpkg --compare-versions "$version" ge "$MIN_VERSION" || return 1
  "$bin" check >/dev/null 2>&1
}

# The mirror the machine already uses for its own release: we add the source suite with the
# same URI so no host name is written anywhere by this project.
mirror_uri() {
  apt-get indextargets --format '$(REPO_URI) $(CODENAME) $(IDENTIFIER)' 2>/dev/null |
    awk -v c="$codename" '$2 == c && $3 == "Packages" { print $1; exit }'
}

# The suite whose CRIU source we use: Debian testing (4.2.1 when this was written); the
# stable releases' 3.17 and 4.1.1 are too old for current kernels.
source_suite() {
  echo "${CKPT_CRIU_SOURCE_SUITE:-forky}"
}

ensure_deb_src() {
  local uri suite
  suite=$(source_suite)
  uri=$(mirror_uri)
  [ -n "$uri" ] || die "cannot find the Debian mirror configured for $codename in apt's sources"
  local want
  want=$(printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$uri" "$suite")
  if [ ! -f "$SOURCES_FILE" ] || [ "$(cat "$SOURCES_FILE")" != "$want" ]; then
    log "adding deb-src for $suite ($SOURCES_FILE)"
    printf '%s\n' "$want" > "$SOURCES_FILE"
    apt_updated=0
  fi
  apt_update_once
}

# Fetches the upstream tarball of CRIU's newest source version, checks its SHA-256 against the
# one apt lists, unpacks it and generates lib/pycriu. Leaves the tree in $SRC_BASE/criu-VERSION.
prepare_source() {
  local have=${1:-}
  if [ -n "$have" ] && [ -f "$SRC_BASE/criu-$have/.ckpt-ready" ]; then
    echo "$SRC_BASE/criu-$have"
    return
  fi
  ensure_deb_src
  local version upstream sha file dir
  version=$(apt-cache showsrc criu | sed -n 's/^Version: //p' | sort -V | tail -n1)
  [ -n "$version" ] || die "apt knows no source package for criu; check $SOURCES_FILE"
  upstream=${version%-*}
  upstream=${upstream#*:}
  dir="$SRC_BASE/criu-$upstream"
  if [ -f "$dir/.ckpt-ready" ]; then
    echo "$dir"
    return
  fi
  file="criu_${upstream}.orig.tar.xz"
  sha=$(apt-cache showsrc criu | awk -v v="$version" -v f="$file" '
    /^Package:/ { ver=""; s=0 }
    /^Version:/ { ver=$2 }
    /^Checksums-Sha256:/ { s=1; next }
    /^[^ ]/ { s=0 }
    s && ver == v && $3 == f { print $1; exit }')
  [ -n "$sha" ] || die "apt lists no SHA-256 for $file"
  mkdir -p "$SRC_BASE"
  (
    cd "$SRC_BASE"
    if [ ! -f "$file" ] || ! echo "$sha  $file" | sha256sum -c --status; then
      rm -f "$file"
      log "downloading CRIU $version source"
      # The registry serves the .orig tarball reliably but the .dsc/.debian.tar.xz not always:
      # apt may complain about those while the tarball we need has arrived.
      apt-get source --download-only "criu=$version" >&2 2>/dev/null || true
    fi
    [ -f "$file" ] || die "could not download $file with apt-get source"
    echo "$sha  $file" | sha256sum -c --status || die "SHA-256 mismatch for $file (expected $sha)"
    log "verified $file (sha256 $sha)"
    rm -rf "$dir.tmp"
    mkdir "$dir.tmp"
    tar -xf "$file" -C "$dir.tmp" --strip-components=1
    log "building CRIU $upstream (criu binary and lib/)"
    make -C "$dir.tmp" -j"$(nproc)" criu lib >"$SRC_BASE/build-$upstream.log" 2>&1 ||
      die "building CRIU failed; see $SRC_BASE/build-$upstream.log"
    touch "$dir.tmp/.ckpt-ready"
    rm -rf "$dir"
    mv "$dir.tmp" "$dir"
  )
  echo "$dir"
}

src_dir=""
installed_version=""
if criu_works /usr/local/sbin/criu; then
  installed_version=$(criu_version /usr/local/sbin/criu)
  log "CRIU $installed_version at /usr/local/sbin/criu passes criu check"
else
  # Prefer the distribution's package where it is new enough (Debian 13: 4.1.1).
  apt_update_once
  candidate=$(apt-cache policy criu | sed -n 's/^ *Candidate: //p')
  if [ -n "$candidate" ] && [ "$candidate" != "(none)" ] &&
     dpkg --compare-versions "$candidate" ge "$MIN_VERSION"; then
    if ! criu_works /usr/sbin/criu; then
      log "installing the distribution's criu $candidate"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq criu >&2
    fi
  fi
  if criu_works /usr/sbin/criu; then
    installed_version=$(criu_version /usr/sbin/criu)
    log "CRIU $installed_version at /usr/sbin/criu passes criu check"
  else
    log "the distribution's CRIU (${candidate:-none}) is missing, too old or fails criu check: building from source"
    src_dir=$(prepare_source)
    install -m 0755 "$src_dir/criu/criu" /usr/local/sbin/criu
    criu_works /usr/local/sbin/criu || die "the CRIU built from source fails 'criu check'; run it by hand to see why"
    log "installed CRIU $(criu_version /usr/local/sbin/criu) at /usr/local/sbin/criu"
  fi
fi

[ -n "$src_dir" ] || src_dir=$(prepare_source "$installed_version")
[ -f "$src_dir/lib/pycriu/rpc_pb2.py" ] || die "pycriu was not generated in $src_dir/lib"
echo "$src_dir/lib"
