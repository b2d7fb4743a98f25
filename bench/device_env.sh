# Sourced by the bench scripts that run on a lent GPU machine (no package registry, no
# libfabric headers; bench/device_prep.sh prepares what they carry).
#   device_env ROOT [PY] [IMPORTS]  the carried wheels (ROOT/.whl) into /tmp/site when IMPORTS
#                                  (default "msgspec, zmq") do not import, and PYTHONPATH set
#                                  to reach them and ROOT; nonzero when the install failed
#   fabric_binding ROOT LOG        the libfabric binding built against the carried headers
#                                  (ROOT/.fabinc) when there are some; nonzero when it failed
device_env() {
  local root=$1 py=${2:-python3} imports=${3:-msgspec, zmq} rc=0
  if ! "$py" -c "import $imports" 2>/dev/null && ls "$root"/.whl/*.whl > /dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$root"/.whl/*.whl || rc=1
    export PYTHONPATH=/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}
  else
    export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
  fi
  return $rc
}

fabric_binding() {
  [ -d "$1/.fabinc" ] || return 0
  DISAGG_FABRIC_INCLUDE=$1/.fabinc timeout 120 python3 -m disagg.fabric.build > "$2" 2>&1
}
