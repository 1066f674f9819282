#!/usr/bin/env bash
# Build the floor (a compiled no-op ext_proc server, floor_server.cc) into .tools/floor/ext_proc_floor.
# Needs Debian's libgrpc++-dev and protobuf-compiler-grpc: installed with apt-get when missing and we
# are root; otherwise one line says why and the script exits 2 (bench_overhead then skips the floor).
# Rebuilds only when ext_proc.proto, floor_server.cc or this script changed (a hash in .tools/floor/stamp).
# Usage: perf/floor/build.sh   (or `make floor`); prints the binary's path on its last line.
# FLOOR_NO_INSTALL=1: never apt-get (the tests build the floor only when the packages are there).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$REPO/.tools/floor"
BIN="$OUT/ext_proc_floor"

have() { command -v protoc >/dev/null && command -v grpc_cpp_plugin >/dev/null && command -v g++ >/dev/null \
         && pkg-config --exists grpc++ protobuf 2>/dev/null; }
if ! have; then
  if [ "${FLOOR_NO_INSTALL:-}" = 1 ]; then
    echo "floor: libgrpc++-dev/protobuf-compiler-grpc not installed (FLOOR_NO_INSTALL=1: not installing them)" >&2
    exit 2
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "floor: libgrpc++-dev/protobuf-compiler-grpc missing and cannot apt-get install them (not root or no apt)" >&2
    exit 2
  fi
  echo "floor: installing libgrpc++-dev protobuf-compiler-grpc g++ pkg-config with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  pkgs=(libgrpc++-dev protobuf-compiler-grpc g++ pkg-config)
  if ! apt-get install -y -q "${pkgs[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q "${pkgs[@]}" >/dev/null 2>&1 || { echo "floor: apt-get install ${pkgs[*]} failed" >&2; exit 2; }
  fi
  have || { echo "floor: packages installed but protoc/grpc_cpp_plugin/pkg-config grpc++ still missing" >&2; exit 2; }
fi

hash="$(cat "$HERE/ext_proc.proto" "$HERE/floor_server.cc" "$HERE/build.sh" | sha256sum | cut -d' ' -f1)"
if [ -x "$BIN" ] && [ "$(cat "$OUT/stamp" 2>/dev/null)" = "$hash" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$OUT/gen"
protoc -I "$HERE" --cpp_out="$OUT/gen" --grpc_out="$OUT/gen" --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" \
  "$HERE/ext_proc.proto"
# shellcheck disable=SC2046
g++ -O2 -std=c++17 -o "$BIN.tmp" -I "$OUT/gen" "$HERE/floor_server.cc" "$OUT/gen/ext_proc.pb.cc" \
  "$OUT/gen/ext_proc.grpc.pb.cc" $(pkg-config --cflags --libs grpc++ protobuf) -pthread
mv "$BIN.tmp" "$BIN"
echo "$hash" > "$OUT/stamp"
echo "$BIN"
