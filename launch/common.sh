# Sourced by launch/*.sh: find a Python flatlm can use (>= 3.11), and `run` (or print, with --dry-run) a command.
python_ok() {  # python_ok PYTHON: whether it runs and is >= 3.11
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2> /dev/null
}

find_python() {  # print the first usable python of FLATLM_PYTHONS (default: python3.13 ... python3), else fail
  local p
  for p in ${FLATLM_PYTHONS:-python3.13 python3.12 python3.11 python3}; do
    if command -v "$p" > /dev/null && python_ok "$(command -v "$p")"; then command -v "$p"; return 0; fi
  done
  return 1
}

quote() {  # one argument as a shell word: as it is when safe, else in single quotes
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+~-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

run() {  # run a command, or with dry=1 print it on stdout as one shell line
  if [ "${dry:-0}" = 1 ]; then
    local out="" a
    for a in "$@"; do out+="$(quote "$a") "; done
    echo "${out% }"
  else
    "$@"
  fi
}
