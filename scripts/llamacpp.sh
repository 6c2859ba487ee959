#!/usr/bin/env bash
# The optional llama.cpp baseline of `verispec bench --llamacpp`, built from source with native CPU flags:
#   1. llama-cpp-python's sdist (it vendors llama.cpp and its GGUF converter), unpacked;
#   2. its wheel, built with CMAKE_ARGS=-DGGML_NATIVE=ON and installed into .venv with the `llama` extra;
#   3. llama.cpp's own llama-speculative, llama-lookup, llama-bench and llama-server from the same vendored sources.
# All of it is kept per CPU under $VERISPEC_CACHE/llama.cpp/VERSION-CPUKEY (default ~/.cache/verispec), so only the
# first run on a machine compiles (about 10 minutes on 2 cores); later runs reinstall the cached wheel if needed.
# Needs .venv (scripts/bootstrap.sh), a C++ compiler and cmake.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || bash "$root/scripts/bootstrap.sh"
py="$venv/bin/python"
pip=("$py" -m pip -q --disable-pip-version-check)
version="$("$py" -c 'from verispec.bench.llamacpp import VERSION; print(VERSION)')"
dir="$("$py" -m verispec.bench.llamacpp build-dir)"
src="$dir/src/llama_cpp_python-$version"
native="-DGGML_NATIVE=ON"
jobs="$(nproc 2>/dev/null || echo 2)"
mkdir -p "$dir"
did=""  # set when this run builds or installs something: the last line then says where it went

if [ ! -f "$dir/bin/recipe" ] || ! ls "$dir"/wheel/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "llamacpp.sh: building llama.cpp $version for this CPU, once (about 10 minutes on 2 cores; later runs" \
    "reuse $dir; VERISPEC_LLAMACPP=0 makes scripts/test.sh skip this and the llama.cpp tests)" >&2
fi

if [ ! -f "$src/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  echo "llamacpp.sh: [1/4] fetching the llama-cpp-python $version sdist" >&2
  did=1
  rm -rf "$dir/src" && mkdir -p "$dir/src"
  "${pip[@]}" download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir/src"
  tar xzf "$dir/src/llama_cpp_python-$version.tar.gz" -C "$dir/src"
fi

if ! ls "$dir"/wheel/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "llamacpp.sh: [2/4] building the llama-cpp-python wheel ($native; the longest step; log in $dir/wheel.log)" >&2
  did=1
  # --no-cache-dir: pip's wheel cache does not know which CPU a native build is for
  CMAKE_ARGS="$native" nice -n 10 "${pip[@]}" wheel --no-deps --no-cache-dir -w "$dir/wheel" \
    "$dir/src/llama_cpp_python-$version.tar.gz" > "$dir/wheel.log" 2>&1 || { tail -20 "$dir/wheel.log"; exit 1; }
fi

stamp="$venv/.verispec-llamacpp"  # which build .venv holds: a .venv moved to another CPU gets that CPU's
if [ "$(cat "$stamp" 2>/dev/null)" != "$dir" ] || ! "$py" -c "import llama_cpp" 2>/dev/null; then
  echo "llamacpp.sh: [3/4] installing it and the \`llama\` extra into $venv" >&2
  did=1
  "${pip[@]}" install --force-reinstall --no-deps "$dir"/wheel/llama_cpp_python-*.whl
  "${pip[@]}" install -e "$root[llama]"  # gguf and the binding's own dependencies; the pin is now satisfied
  echo "$dir" > "$stamp"
fi

bins=(llama-speculative llama-lookup llama-bench llama-server)
recipe="static, native, log flushed at exit, server"  # change it to rebuild the binaries of an existing cache
if [ "$(cat "$dir/bin/recipe" 2>/dev/null)" != "$recipe" ]; then
  echo "llamacpp.sh: [4/4] building ${bins[*]} (log in $dir/build.log)" >&2
  did=1
  # llama.cpp leaks its logger at exit, so lines still queued when main returns can be lost (its issue 22142), and
  # llama-speculative and llama-lookup print their output and counters last: flush the log before main returns.
  for f in examples/speculative/speculative.cpp examples/lookup/lookup.cpp; do
    grep -q "common_log_flush(common_log_main())" "$src/vendor/llama.cpp/$f" ||
      perl -0pi -e 's/(\n    return 0;\n\}\s*)\z/\n    common_log_flush(common_log_main());$1/' \
        "$src/vendor/llama.cpp/$f"
    grep -q "common_log_flush(common_log_main())" "$src/vendor/llama.cpp/$f"
  done
  gen=()
  if command -v ninja >/dev/null; then gen=(-G Ninja); fi
  # static: the binaries do not depend on the wheel's shared libraries
  cmake -S "$src/vendor/llama.cpp" -B "$dir/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "$native" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON > "$dir/build.log" 2>&1 \
    || { tail -20 "$dir/build.log"; exit 1; }
  nice -n 10 cmake --build "$dir/build" -j "$jobs" --target "${bins[@]}" >> "$dir/build.log" 2>&1 \
    || { tail -20 "$dir/build.log"; exit 1; }
  mkdir -p "$dir/bin"
  for b in "${bins[@]}"; do cp "$dir/build/bin/$b" "$dir/bin/"; done
  echo "$recipe" > "$dir/bin/recipe"
  rm -rf "$dir/build"  # the objects (hundreds of MB); the binaries are what is kept
fi
[ -z "$did" ] || echo "llamacpp.sh: done: llama-cpp-python $version in $venv; binaries in $dir/bin" >&2
