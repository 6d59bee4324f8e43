#!/usr/bin/env bash
# Build a root filesystem for gatewayd's sandbox without Docker: Debian 12 (bookworm),
# the minbase variant, plus python3 (cogni-tool's interpreter) and the CA bundle.
#
#   usage: build-debootstrap.sh DIR [MIRROR]      as root, with the debootstrap package
#   EXTRA_PACKAGES=build-essential,git build-debootstrap.sh DIR    adds packages (comma list)
#
# Then use it with `gatewayd run --image DIR ...`. See README.md in this directory.
set -euo pipefail

readonly SUITE=bookworm
readonly DEFAULT_MIRROR=http://deb.debian.org/debian
readonly PACKAGES=python3,ca-certificates${EXTRA_PACKAGES:+,$EXTRA_PACKAGES}
# What gatewayd mounts over inside the image. The image is bound read-only, so bwrap cannot
# create these itself: they must exist, directories as directories and files as files.
readonly MOUNT_DIRS=(proc dev tmp workspace opt/cogni-tool run/cogni etc)
readonly MOUNT_FILES=(etc/passwd etc/group etc/hosts run/cogni/gateway.sock)

fail() {
	echo "build-debootstrap.sh: $1" >&2
	exit "${2:-1}"
}

[ $# -ge 1 ] && [ $# -le 2 ] || fail "usage: build-debootstrap.sh DIR [MIRROR] (default MIRROR: $DEFAULT_MIRROR)" 2
dir=$1
mirror=${2:-$DEFAULT_MIRROR}

case $dir in
/*) ;;
*) fail "DIR must be an absolute path (gatewayd binds it as given), e.g. /srv/cogni/images/bookworm; got '$dir'" 2 ;;
esac
[ "$(id -u)" = 0 ] || fail "run as root: the image's files must be owned by root, and debootstrap makes device nodes"
command -v debootstrap >/dev/null || fail "debootstrap is not installed; install it: apt-get install debootstrap"
if [ -e "$dir" ] && { [ ! -d "$dir" ] || [ -n "$(ls -A "$dir")" ]; }; then
	fail "$dir exists and is not an empty directory; give a new (or empty) directory: an image is built from scratch, never over another one"
fi

umask 022
mkdir -p "$dir"
chmod 0755 "$dir"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$dir" "$mirror"

# debootstrap copies the host's resolv.conf and hostname in; the host's /etc never enters
# an image (there is no DNS in the sandbox, and gatewayd sets the hostname).
rm -f "$dir/etc/resolv.conf" "$dir/etc/hostname"
# Packages fetched while building: nothing in the sandbox runs apt (it has no network).
rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*

for d in "${MOUNT_DIRS[@]}"; do mkdir -p "$dir/$d"; done
for f in "${MOUNT_FILES[@]}"; do [ -f "$dir/$f" ] || : >"$dir/$f"; done
chmod 0755 "$dir/tmp" # a tmpfs covers it in the sandbox; the image's own copy is not shared scratch space

# The image's owners and groups are host ids on the host: a group- or other-writable file
# is one that some host user could change under every later run. Nothing stays writable.
find "$dir" -xdev \( -type d -o -type f \) -perm /022 -exec chmod go-w {} +

echo "image built in $dir; check it (and fix what it lists) with:"
echo "  gatewayd image check $dir"
