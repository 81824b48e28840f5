#!/bin/bash
# The kit smartinf needs on a lent GPU machine (Python 3.12, torch there, nothing
# installable), as a recipe: `fetch` here downloads into .devkit/ (git-ignored, carried to
# the machine: `carry: [".devkit"]`); `setup` there unpacks it and builds smartinf into
# /tmp/kit; `source bench/gpu_kit.sh env` there sets the paths for what runs after.
#
#   bash bench/gpu_kit.sh fetch                       # here, once per checkout
#   bash bench/gpu_kit.sh setup && source bench/gpu_kit.sh env   # there, in one run
#   OUT=$OUT bash bench/gpu_kit.sh pack               # there: the built kit, to carry later
#   bash bench/gpu_kit.sh squeeze FOLDER              # here: those pieces into .kitcache/, smaller
#   bash bench/gpu_kit.sh unpack && source bench/gpu_kit.sh env  # there, carrying .kitcache
#   bash bench/gpu_kit.sh rebuild                     # there, after unpack + env: a changed core
#                                                     # (SMARTINF_WITH_CUDA=OFF: without the CUDA device, faster)
#   bash bench/gpu_kit.sh core && source bench/gpu_kit.sh env    # there: smartinf alone, for
#                                                     # the host's figures (no CUDA device, no DeepSpeed;
#                                                     # SMARTINF_WITH_CUDA=ON: with it, for the GPU tests)
#
# `setup` also installs DeepSpeed (its sdist and the wheels the machine lacks) and compiles
# its async_io and cpu_adam ops into $TORCH_EXTENSIONS_DIR while smartinf builds, for the
# head-to-heads (bench/gpu_headtohead.sh).
set -u
KIT=${KIT:-.devkit}
PREFIX=${PREFIX:-/tmp/kit}
WHEELS="cython scikit-build-core cmake ninja packaging pathspec tqdm pytest pluggy iniconfig pytest-benchmark py-cpuinfo"
DEBS="liburing-dev liburing2 libxxhash-dev libxxhash0 zlib1g-dev libaio-dev libaio1"
DEEPSPEED=deepspeed==0.19.8
DS_WHEELS="hjson pydantic pydantic-core annotated-types typing-inspection typing_extensions msgpack einops psutil"

# The Debian packages into $PREFIX/root, the paths set (env), the libraries' dev links.
unpack_debs() {
  mkdir -p "$PREFIX/root" "$PREFIX/site"
  for f in "$KIT"/debs/*.deb; do dpkg -x "$f" "$PREFIX/root"; done
  source "$0" env
  # zlib1g-dev's libz.so points at Debian's libz.so.1.x: use the machine's own zlib.
  [ -e "$LIB/libz.so" ] || ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1 2>/dev/null | head -1)" "$LIB/libz.so"
  [ -e "$LIB/libaio.so" ] || ln -sf "$(cd "$LIB" && ls libaio.so.1* | head -1)" "$LIB/libaio.so"
}

case ${1:-} in
  fetch)
    mkdir -p "$KIT/wheels" "$KIT/debs" "$KIT/sdist"
    pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --platform any --python-version 3.12 -d "$KIT/wheels" $WHEELS $DS_WHEELS
    pip download -q --no-deps --no-binary=:all: -d "$KIT/sdist" $DEEPSPEED
    (cd "$KIT/debs" && apt-get download $DEBS)
    du -sh "$KIT"
    ;;
  setup)
    unpack_debs
    python3 -m pip install -q --no-index --find-links "$KIT/wheels" --target "$PREFIX/site" $WHEELS $DS_WHEELS
    python3 -m pip install -q --no-deps --no-build-isolation --target "$PREFIX/site" "$KIT"/sdist/deepspeed-*.tar.gz
    # DeepSpeed's JIT ops compile while smartinf builds (each takes minutes).
    python3 -c "from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
AsyncIOBuilder().load(); CPUAdamBuilder().load(); print('deepspeed ops built')" > /tmp/kit-ds-ops.log 2>&1 &
    CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-deps --no-build-isolation \
      --target "$PREFIX/site" -Cbuild-dir=/tmp/kit-build .
    python3 -c "import smartinf; print('smartinf built with', smartinf.build_info())"
    wait; tail -3 /tmp/kit-ds-ops.log
    ;;
  core)
    # smartinf without its CUDA device or DeepSpeed, for the probe's storage and host
    # figures. On the H100 machine it took 4m17s, user time as long as real: one unit,
    # cpu_device.cc with every host kernel, compiled alone; those kernels are now three
    # units compiled in parallel (115 s the longest here). `pack` once and `unpack` after
    # saves the device time.
    unpack_debs
    python3 -m pip install -q --no-index --find-links "$KIT/wheels" --target "$PREFIX/site" $WHEELS
    CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-deps --no-build-isolation \
      --target "$PREFIX/site" -Cbuild-dir=/tmp/kit-build -Ccmake.define.SMARTINF_WITH_CUDA="${SMARTINF_WITH_CUDA:-OFF}" .
    python3 -c "import smartinf; print('smartinf built with', smartinf.build_info())"
    ;;
  pack)
    # The built kit into $OUT in pieces the device tool brings back (16 MiB a file); put them
    # in .kitcache/ here and carry that: `unpack` then replaces `setup` (minutes saved a call).
    tar -C "$PREFIX" -czf /tmp/kit.tgz --exclude='site/cmake*' --exclude='site/bin/cmake*' \
      --exclude='site/Cython*' --exclude='site/cython*' --exclude='*/__pycache__' \
      site root torch_extensions
    split -b 15M -d /tmp/kit.tgz "${OUT:?}/kit.tgz."
    du -sh /tmp/kit.tgz
    ;;
  squeeze)
    # Here: the pieces `pack` brought back (in the folder given) recompressed with xz into
    # .kitcache/ (60 MB of gzip became 38 MB: with the tree, under the 64 MiB a call carries).
    rm -rf "${KITCACHE:-.kitcache}" && mkdir -p "${KITCACHE:-.kitcache}"
    cat "${2:?usage: squeeze FOLDER}"/kit.tgz.* | gzip -dc | xz -T0 -6 \
      | split -b 15M -d - "${KITCACHE:-.kitcache}/kit.txz."
    du -sh "${KITCACHE:-.kitcache}"
    ;;
  unpack)
    # A kit packed by `pack` (from .kitcache/, gzip or squeezed), with this checkout's Python
    # files over the built package (the native core must be unchanged since the pack).
    # Python's tarfile reads either compression, whatever tools the machine has.
    mkdir -p "$PREFIX"
    cat "${KITCACHE:-.kitcache}"/kit.t?z.* | python3 -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|*').extractall(sys.argv[1], filter='fully_trusted')" "$PREFIX"
    cp -r src/smartinf/. "$PREFIX/site/smartinf/"
    ;;
  rebuild)
    # After `unpack`, where the native core changed: smartinf built again (Cython from
    # .kitextra/, the machine's CMake; its nvcc builds the CUDA device too).
    python3 -m pip install -q --no-index --no-deps --target "$PREFIX/site" .kitextra/cython-*.whl
    CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-deps --no-build-isolation --upgrade \
      --target "$PREFIX/site" -Cbuild-dir=/tmp/kit-build -Ccmake.define.SMARTINF_WITH_CUDA="${SMARTINF_WITH_CUDA:-ON}" .
    ;;
  env)
    LIB="$PREFIX/root/usr/lib/x86_64-linux-gnu"
    export CPATH="$PREFIX/root/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export CMAKE_PREFIX_PATH="$PREFIX/root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export PYTHONPATH="$PREFIX/site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$PREFIX/site/bin:$PATH"
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PREFIX/torch_extensions}
    export TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed's op builder cannot parse the machine's "9.0a"
    ;;
  *) echo "usage: bash bench/gpu_kit.sh fetch|setup|core|pack|squeeze|unpack|rebuild; source bench/gpu_kit.sh env" >&2; exit 2 ;;
esac
