# Sourced by setup.sh and engine_env.sh: a virtual environment whose install is skipped while
# a stamp in it holds the hash of the files the install depends on.

# venv_current VENV FILE... : create VENV if missing; succeed when its stamp matches the FILEs
venv_current() {
    local venv=$1
    shift
    if [[ ! -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv"
    fi
    [[ -f "$venv/.installed" && "$(cat "$venv/.installed")" == "$(cat "$@" | sha256sum)" ]]
}

# venv_stamp VENV FILE... : record that VENV's install matches the FILEs
venv_stamp() {
    local venv=$1
    shift
    cat "$@" | sha256sum > "$venv/.installed"
}
