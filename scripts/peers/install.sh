#!/usr/bin/env bash
# Device side: install a peer's carried wheels into its own site directory.
#   bash scripts/peers/install.sh vllm|sglang      ->  /tmp/peers/<peer>  (scripts/bench_peers.py --peer-site)
# The pieces of .gpu/xfer/<peer>-wheels.tar (scripts/peers/fetch_wheels.py) must have been copied to
# /tmp/xfer/ by earlier calls. --no-deps: the lock lists every wheel the image lacks; the image's torch,
# transformers (unless the lock pins another), numpy, ... are used as they are.
set -euo pipefail
peer=$1
site=/tmp/peers/$peer
[ -f "$site/.installed" ] && { echo "$peer already installed in $site"; exit 0; }
work=$(mktemp -d)
cat /tmp/xfer/"$peer"-wheels.tar.part.* | tar xf - -C "$work"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$work"/*.whl
rm -rf "$work" && touch "$site/.installed"
echo "$peer: $(ls "$site" | wc -l) entries in $site"
