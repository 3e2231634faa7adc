#!/usr/bin/env bash
# Fill .peers/flashmla (git-ignored) with what `python -m kreg.benchmarks.flashmla_peer` builds: FlashMLA's
# SM90 sparse-prefill sources and the CUTLASS headers at the commit FlashMLA pins, and pack them as
# .peers/flashmla.tar.xz (about 3 MB) to carry to a GPU machine that has no network.
#
#   git clone https://github.com/deepseek-ai/FlashMLA && git -C FlashMLA submodule update --init csrc/cutlass
#   scripts/flashmla_sources.sh FlashMLA            # or: scripts/flashmla_sources.sh FlashMLA CUTLASS_CHECKOUT
#
# With a CUTLASS checkout given apart (any clone holding the pinned commit), the headers come from that
# commit. Nothing here is committed: the sources stay FlashMLA's and NVIDIA's.
set -euo pipefail
flashmla=${1:?usage: scripts/flashmla_sources.sh FLASHMLA_CHECKOUT [CUTLASS_CHECKOUT]}
cutlass=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/.peers/flashmla
rm -rf "$dest" && mkdir -p "$dest"

# FlashMLA's tree as committed (a bare mirror or a work tree): its csrc/ pieces the SM90 sparse prefill needs.
export_tree() {  # repo commit paths... -> into $dest
  local repo=$1 commit=$2; shift 2
  git -C "$repo" archive "$commit" "$@" | tar -x -C "$dest"
}
commit=$(git -C "$flashmla" rev-parse HEAD)
export_tree "$flashmla" "$commit" csrc/params.h csrc/utils.h csrc/defines.h csrc/sm90/helpers.h \
  csrc/sm90/prefill/sparse csrc/kerutils/include
pinned=$(git -C "$flashmla" ls-tree "$commit" csrc/cutlass | awk '{print $3}')
if [ -z "$cutlass" ]; then
  cutlass=$flashmla/csrc/cutlass
fi
git -C "$cutlass" archive --prefix=csrc/cutlass/ "$pinned" include tools/util/include | tar -x -C "$dest"
printf 'FlashMLA %s\nCUTLASS %s\n' "$commit" "$pinned" > "$dest/SOURCES"
tar -C "$root/.peers" -cJf "$root/.peers/flashmla.tar.xz" flashmla
du -sh "$dest" "$root/.peers/flashmla.tar.xz"
