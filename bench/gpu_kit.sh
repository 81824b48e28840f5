#!/bin/bash
# The kit smartinf needs on a lent GPU machine (Python 3.12, torch there, nothing
# installable), as a recipe: `fetch` here downloads into .devkit/ (git-ignored, carried to
# the machine: `carry: [".devkit"]`); `setup` there unpacks it and builds smartinf into
# /tmp/kit; `source bench/gpu_kit.sh env` there sets the paths for what runs after.
#
#   bash bench/gpu_kit.sh fetch                       # here, once per checkout
#   bash bench/gpu_kit.sh setup && source bench/gpu_kit.sh env   # there, in one run
#
# DeepSpeed for the head-to-heads is not in this minimal kit yet (see the developers' guide:
# its sdist, hjson, pydantic and friends, libaio, TORCH_CUDA_ARCH_LIST=9.0).
set -u
KIT=${KIT:-.devkit}
PREFIX=${PREFIX:-/tmp/kit}
WHEELS="cython scikit-build-core cmake ninja packaging pathspec tqdm pytest pluggy iniconfig pytest-benchmark py-cpuinfo"
DEBS="liburing-dev liburing2 libxxhash-dev libxxhash0 zlib1g-dev"

case ${1:-} in
  fetch)
    mkdir -p "$KIT/wheels" "$KIT/debs"
    pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --platform any --python-version 3.12 -d "$KIT/wheels" $WHEELS
    (cd "$KIT/debs" && apt-get download $DEBS)
    du -sh "$KIT"
    ;;
  setup)
    mkdir -p "$PREFIX/root" "$PREFIX/site"
    for f in "$KIT"/debs/*.deb; do dpkg -x "$f" "$PREFIX/root"; done
    source "$0" env
    # zlib1g-dev's libz.so points at Debian's libz.so.1.x: use the machine's own zlib.
    [ -e "$LIB/libz.so" ] || ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1 2>/dev/null | head -1)" "$LIB/libz.so"
    python3 -m pip install -q --no-index --find-links "$KIT/wheels" --target "$PREFIX/site" $WHEELS
    CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-deps --no-build-isolation \
      --target "$PREFIX/site" -Cbuild-dir=/tmp/kit-build .
    python3 -c "import smartinf; print('smartinf built with', smartinf.build_info())"
    ;;
  env)
    LIB="$PREFIX/root/usr/lib/x86_64-linux-gnu"
    export CPATH="$PREFIX/root/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export CMAKE_PREFIX_PATH="$PREFIX/root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export PYTHONPATH="$PREFIX/site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$PREFIX/site/bin:$PATH"
    ;;
  *) echo "usage: bash bench/gpu_kit.sh fetch|setup; source bench/gpu_kit.sh env" >&2; exit 2 ;;
esac
