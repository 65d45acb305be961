#!/usr/bin/env bash
# The GPU libraries' Python code, for tests/engine/test_real_libraries.py: flash-attn's sdists (installed
# without their CUDA build) and TransformerEngine's pure-Python wheels, one folder per version under
# .gl/ (git-ignored), each on its own sys.path in the test's worker processes. No C++ extension is
# built or downloaded: the tests emulate flash_attn_2_cuda and transformer_engine_torch on CPU.
#
# Idempotent: a version whose folder holds .installed is skipped. Never fails CI: a version that
# cannot be fetched (registry unreachable) is reported here, and its tests skip with that reason.
#
#   bash scripts/ci/gpu_libs.sh            # every version of the matrix
#   PYTHON=/path/to/python bash scripts/ci/gpu_libs.sh
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-.venv/bin/python}"
GL=.gl
WHL=.whl
FLASH_VERSIONS=(2.6.3 2.7.4.post1 2.8.3)
TE_VERSIONS=(1.13.0 2.1.0 2.8.0 2.14.0 2.15.0 2.20.2)
start=$(date +%s)
failed=()
note() { echo "gpu_libs: $*" >&2; }

# flash-attn's setup.py imports torch: the repo's venv first (make builds it once, as make test would).
if [ "$PYTHON" = .venv/bin/python ] && [ ! -f .venv/.installed ]; then
    make -s .venv/.installed || note "could not build .venv"
fi
mkdir -p "$GL" "$WHL"

# flash-attn's setup.py imports wheel; it goes to its own folder so the shared venv stays as it is.
if [ ! -f "$GL/tools/.installed" ]; then
    rm -rf "$GL/tools"
    if "$PYTHON" -m pip install -q --disable-pip-version-check --target "$GL/tools" wheel; then
        touch "$GL/tools/.installed"
    else
        note "could not install wheel (needed to build flash-attn's sdist); flash-attn versions skipped"
    fi
fi

for v in "${FLASH_VERSIONS[@]}"; do
    dest="$GL/flash-attn-$v"
    [ -f "$dest/.installed" ] && continue
    [ -f "$GL/tools/.installed" ] || { failed+=("flash-attn==$v"); continue; }
    rm -rf "$dest"
    # SKIP_CUDA_BUILD: Python only; FORCE_BUILD: no look for a prebuilt CUDA wheel; no isolation: the
    # venv's torch (its setup.py imports torch).
    if FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE PYTHONPATH="$GL/tools" \
        "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
        --target "$dest" "flash-attn==$v"; then
        touch "$dest/.installed"
    else
        rm -rf "$dest"
        failed+=("flash-attn==$v")
    fi
done

# TE's common/recipe imports pydantic (a dependency of every TE 2.x); its own folder, appended to sys.path.
# pydantic's core is compiled: one folder per Python (tests/engine/real_libraries.py's TE_DEPS).
deps="$GL/te-deps-py$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
if [ ! -f "$deps/.installed" ]; then
    rm -rf "$deps"
    if "$PYTHON" -m pip install -q --disable-pip-version-check --target "$deps" pydantic; then
        touch "$deps/.installed"
    else
        failed+=("pydantic")
        note "could not install pydantic (TE 2.x imports it); TE 2.x tests skip"
    fi
fi

for v in "${TE_VERSIONS[@]}"; do
    dest="$GL/te-$v"
    [ -f "$dest/.installed" ] && continue
    rm -rf "$dest"
    wheel="$(ls "$WHL"/transformer_engine-"$v"-py3-none-any.whl 2>/dev/null | head -n 1)"
    if [ -z "$wheel" ]; then
        "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
            -d "$WHL" "transformer-engine==$v" \
            && wheel="$(ls "$WHL"/transformer_engine-"$v"-py3-none-any.whl 2>/dev/null | head -n 1)"
    fi
    if [ -n "$wheel" ] && mkdir -p "$dest" && "$PYTHON" -m zipfile -e "$wheel" "$dest"; then
        touch "$dest/.installed"
    else
        rm -rf "$dest"
        failed+=("transformer-engine==$v")
    fi
done

if [ ${#failed[@]} -gt 0 ]; then
    printf '%s\n' "${failed[@]}" > "$GL/FAILED"
    note "not installed: ${failed[*]} (their tests skip with this reason; rerun when the registry is reachable)"
else
    rm -f "$GL/FAILED"
fi
note "done in $(( $(date +%s) - start )) s: $(ls -d "$GL"/flash-attn-* "$GL"/te-* 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"
exit 0
