# cached_venv PYTHON REQUIREMENTS: print the path of a venv made by PYTHON with
# REQUIREMENTS installed, kept outside the clone and keyed by the interpreter's
# version and the requirements' text, so a second run on the same machine reuses it.
# A venv is usable only once its `.complete` marker exists (an interrupted build
# is thrown away and redone).
CI_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/mindspeed-laga"

cached_venv() {
    local python=$1 requirements=$2 version key venv
    version=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
    key=$( { echo "$version"; cat "$requirements"; } | sha256sum | cut -c1-16)
    venv="$CI_CACHE/venvs/py$version-$key"
    if [ ! -f "$venv/.complete" ]; then
        rm -rf "$venv"
        mkdir -p "$CI_CACHE/venvs"
        "$python" -m venv "$venv" >&2
        "$venv/bin/python" -m pip install -q -r "$requirements" >&2
        touch "$venv/.complete"
    fi
    echo "$venv"
}
