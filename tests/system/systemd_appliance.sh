#!/usr/bin/env bash
# The appliance under a real systemd (`./run test-system`, as root on Debian or Ubuntu).
#
# Makes a Debian bookworm root file system with debootstrap (once: cached in $CACHE with a wheelhouse of
# the project's dependencies), copies this source tree into a fresh copy of it, boots systemd as PID 1 of
# a systemd-nspawn container, installs edge-server there the way jetson/README.md says for a box without
# TensorRT, and checks what a person relies on: the first start after install (Type=notify, STATUS=),
# journald's fields, clients and operators, reload, drain on stop, stop while a model loads, a watchdog
# restart, a model that fails at start-up, start at boot, the hardening score and uninstall --purge.
#
# Exit status: 0 when every check passed, or when this machine cannot run the test (not root, no
# systemd-nspawn, a container that cannot start): then the first line says "SKIPPED" and why.
# Environment: EDGE_SERVER_SYSTEM_TEST_CACHE (default /var/cache/edge-server-system-test),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), EDGE_SERVER_SYSTEM_TEST_KEEP=1 keeps the
# container's files (the path is printed).
set -uo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${EDGE_SERVER_SYSTEM_TEST_CACHE:-/var/cache/edge-server-system-test}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PACKAGES=systemd,systemd-sysv,dbus,python3,python3-venv,python3-pip,passwd,procps
MACHINE=edge-server-st
FAILED=0
STARTED=$(date +%s)

say() { printf '%s  %s\n' "$(date +%H:%M:%S)" "$*"; }
skip() { echo "test-system: SKIPPED: $*"; exit 0; }
die() { say "ERROR: $*"; exit 1; }
pass() { say "ok    $*"; }
fail() {
    say "FAIL  $*"
    FAILED=$((FAILED + 1))
    if [ -n "${LEADER:-}" ]; then  # what the service said last
        x systemctl status edge-server --no-pager -n 0 2>&1 | sed -n '1,6s/^/        | /p'
        x journalctl -u edge-server --no-pager -o cat -n 12 2>&1 | sed 's/^/        | /'
    fi
}
check() {  # check DESCRIPTION COMMAND...: pass or fail, and go on
    local what=$1
    shift
    if "$@"; then pass "$what"; else fail "$what"; fi
}

[ "$(uname -s)" = Linux ] || skip "needs Linux"
[ "$(id -u)" = 0 ] || skip "needs root: sudo ./run test-system"
if ! command -v systemd-nspawn >/dev/null || ! command -v debootstrap >/dev/null; then
    command -v apt-get >/dev/null || skip "needs systemd-nspawn and debootstrap (systemd-container, debootstrap)"
    say "installing systemd-container and debootstrap (apt-get)"
    { apt-get update -qq && apt-get install -y -qq systemd-container debootstrap; } >/dev/null 2>&1 ||
        skip "could not install systemd-container and debootstrap with apt-get"
fi

ARCH=$(dpkg --print-architecture 2>/dev/null || uname -m)
BASE=$CACHE/$SUITE-$ARCH-1  # bump the suffix when PACKAGES change
WORK=$(mktemp -d /var/tmp/edge-server-system-test.XXXXXX)
ROOT=$WORK/root
CGROUPS=()
NSPAWN=""
LEADER=""

cleanup() {
    if [ -n "$NSPAWN" ] && kill -0 "$NSPAWN" 2>/dev/null; then
        kill "$NSPAWN" 2>/dev/null  # the container shuts down; killed if it takes over 10 s
        for _ in $(seq 100); do kill -0 "$NSPAWN" 2>/dev/null || break; sleep 0.1; done
        kill -KILL ${LEADER:+"$LEADER"} "$NSPAWN" 2>/dev/null  # the container's init does not die with nspawn
        wait "$NSPAWN" 2>/dev/null
    fi
    for group in "${CGROUPS[@]}"; do
        find "$group" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    if [ "${EDGE_SERVER_SYSTEM_TEST_KEEP:-0}" = 1 ]; then
        say "kept $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # through cleanup: the container and its cgroups go too

# -- containers ------------------------------------------------------------------------------------

own_cgroup() {  # own_cgroup NAME COMMAND...: exec COMMAND (systemd-nspawn --keep-unit) in a cgroup of its own
    local name=$1 dirs=()
    shift
    if [ -d /run/systemd/system ]; then  # a systemd host: a transient scope is that cgroup
        exec systemd-run --quiet --scope --collect -p Delegate=yes -- "$@"
    fi
    # No systemd on the host (a CI container): make the cgroups by hand, in every hierarchy nspawn uses.
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        dirs=("/sys/fs/cgroup/$name")
    else
        [ -d /sys/fs/cgroup/unified ] && dirs+=("/sys/fs/cgroup/unified/$name")
        [ -d /sys/fs/cgroup/systemd ] && dirs+=("/sys/fs/cgroup/systemd/$name")
    fi
    for dir in "${dirs[@]}"; do
        mkdir -p "$dir" && echo "$BASHPID" >"$dir/cgroup.procs" || exit 125
    done
    exec "$@"
}

nspawn_run() {  # nspawn_run ROOT ARGS...: one command in the container, no init; host network
    local root=$1
    shift
    local name=edge-server-system-test-$$-$RANDOM
    CGROUPS+=("/sys/fs/cgroup/$name" "/sys/fs/cgroup/unified/$name" "/sys/fs/cgroup/systemd/$name")
    (own_cgroup "$name" systemd-nspawn --quiet --register=no --keep-unit -D "$root" "$@")
}

boot() {  # boot LOG: systemd as PID 1 of the container, in the background; waits until it runs
    local log=$1 name=edge-server-system-test-$$-$RANDOM
    CGROUPS+=("/sys/fs/cgroup/$name" "/sys/fs/cgroup/unified/$name" "/sys/fs/cgroup/systemd/$name")
    (own_cgroup "$name" systemd-nspawn --quiet -D "$ROOT" -b --private-network --register=no --keep-unit \
        -M "$MACHINE" --bind-ro="$WHEELS:/wheels" </dev/null >"$log" 2>&1) &
    NSPAWN=$!
    LEADER=""
    local i state
    for i in $(seq 600); do
        kill -0 "$NSPAWN" 2>/dev/null || return 1
        LEADER=$(cat /proc/"$NSPAWN"/task/*/children 2>/dev/null | awk '{print $1; exit}')
        if [ -n "$LEADER" ] && [ "$(cat /proc/"$LEADER"/comm 2>/dev/null)" = systemd ]; then
            export LEADER
            state=$(x systemctl is-system-running --wait 2>/dev/null)
            case "$state" in
            running) return 0 ;;
            degraded) say "      the container booted degraded: $(x systemctl --failed --no-legend --plain | tr '\n' ' ')"; return 0 ;;
            esac
        fi
        sleep 0.1
    done
    return 1
}

shutdown_container() {
    x systemctl poweroff >/dev/null 2>&1
    local i
    for i in $(seq 600); do
        kill -0 "$NSPAWN" 2>/dev/null || { wait "$NSPAWN" 2>/dev/null; NSPAWN=""; return 0; }
        sleep 0.1
    done
    kill "$NSPAWN"
    wait "$NSPAWN" 2>/dev/null
    NSPAWN=""
    return 1
}

x() {  # x COMMAND...: run in the booted container, as root, with a clean environment
    nsenter -t "$LEADER" -m -u -i -n -p -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        LANG=C.UTF-8 HOME=/root PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}
as() {  # as USER COMMAND...: as that user, for at most 2 minutes
    local user=$1
    shift
    x timeout 120 runuser -u "$user" -- "$@"
}
show() { x systemctl show edge-server -P "$1"; }
wait_until() {  # wait_until SECONDS COMMAND...: true once COMMAND succeeds
    local deadline=$(($(date +%s) + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || return 1
        sleep 0.2
    done
}

# -- the cached root file system and wheelhouse ------------------------------------------------------

mkdir -p "$CACHE"
if [ ! -d "$BASE" ]; then
    say "making the $SUITE root file system with debootstrap (once; cached in $BASE)"
    rm -rf "$BASE.tmp"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$BASE.tmp" "$MIRROR" \
        >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log"; die "debootstrap failed"; }
    mv "$BASE.tmp" "$BASE"
fi
if ! nspawn_run "$BASE" --read-only --private-network /bin/true >"$WORK/nspawn-check.log" 2>&1; then
    cat "$WORK/nspawn-check.log"
    skip "systemd-nspawn cannot run a container here (see above)"
fi

say "copying the source tree and the root file system"
mkdir -p "$WORK/src"
if git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$SRC" ls-files -z -co --exclude-standard | (cd "$SRC" && tar --null -T - -cf -) | tar -C "$WORK/src" -xf -
else
    tar -C "$SRC" --exclude=.venv --exclude=.git -cf - . | tar -C "$WORK/src" -xf -
fi
cp -a --reflink=auto "$BASE" "$ROOT"
mkdir -p "$ROOT/opt/edge-server"
cp -a "$WORK/src" "$ROOT/opt/edge-server/src"

HASH=$(sha256sum "$SRC/pyproject.toml" | cut -c1-16)
WHEELS=$CACHE/wheels-$SUITE-$ARCH-$HASH
if [ ! -d "$WHEELS" ]; then
    say "downloading the dependencies into a wheelhouse (once per pyproject.toml; $WHEELS)"
    rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp"
    # The host's certificate authorities (a proxy that inspects TLS) and package index, where it has them.
    HOST_PIP=()
    CA=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
    [ -f "$CA" ] && HOST_PIP+=(--bind-ro="$CA:/etc/host-ca.crt" --setenv=PIP_CERT=/etc/host-ca.crt)
    for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_DEFAULT_TIMEOUT; do
        [ -n "${!var:-}" ] && HOST_PIP+=(--setenv="$var=${!var}")
    done
    nspawn_run "$ROOT" --bind="$WHEELS.tmp:/wheels" --bind-ro="$WORK/src:/src" --tmpfs=/tmp --setenv=HOME=/tmp \
        "${HOST_PIP[@]}" \
        sh -c 'python3 -m venv /tmp/w && cp -a /src /tmp/src &&
               /tmp/w/bin/pip wheel -q --wheel-dir /wheels "/tmp/src[grpc,models]" setuptools wheel &&
               rm -f /wheels/edge_server-*' >"$WORK/wheels.log" 2>&1 ||
        { tail -20 "$WORK/wheels.log"; die "could not make the wheelhouse"; }
    mv "$WHEELS.tmp" "$WHEELS"
fi
PREPARED=$(date +%s)

# -- models the checks drop into the repository -------------------------------------------------------

python_model() {  # python_model DIR NAME BODY
    mkdir -p "$1/$2/1"
    cat >"$1/$2/config.pbtxt" <<EOF
name: "$2"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
EOF
    printf '%s\n' "$3" >"$1/$2/1/model.py"
}
DROPS=$ROOT/root/drops
python_model "$DROPS" slow '
import pathlib
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        pathlib.Path("/var/lib/edge-server/slow-started").touch()
        time.sleep(4)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]'
python_model "$DROPS" stuck '
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3600)

    def execute(self, requests):
        raise AssertionError("never initialized")'
mkdir -p "$DROPS/broken/1"
printf 'name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: 0\n' >"$DROPS/broken/config.pbtxt"
printf 'not an onnx model' >"$DROPS/broken/1/model.onnx"

drop() {  # drop NAME: into the repository the OTA way (copied beside it, renamed into place)
    x sh -c "cp -a /root/drops/$1 /var/lib/edge-server/models/.$1 && chown -R edge-server:edge-server \
        /var/lib/edge-server/models/.$1 && mv /var/lib/edge-server/models/.$1 /var/lib/edge-server/models/$1"
}
model_state() {  # model_state NAME STATE: the daemon lists NAME in STATE
    as alice edge-server models | awk -v n="$1" -v s="$2" '$1 == n && $0 ~ s {found=1} END {exit !found}'
}
fresh_start() {  # reset systemd's start counter (the checks start the unit more often than a person)
    x systemctl reset-failed edge-server >/dev/null 2>&1
    x systemctl start edge-server
}
journal_since() { x journalctl -u edge-server --no-pager -o cat --since "@$1"; }
daemon_log() { x journalctl _SYSTEMD_UNIT=edge-server.service --no-pager -o cat "$@"; }  # its own lines
CONTROL='import sys
from edge_server.client import Client
with Client(timeout=30) as client:
    getattr(client, sys.argv[1] + "_model")("identity")'
control() { as "$1" /opt/edge-server/venv/bin/python -c "$CONTROL" "$2"; }  # control USER load|unload
export CONTROL
export -f say x as show wait_until model_state journal_since daemon_log control

# -- boot and install -------------------------------------------------------------------------------

say "booting systemd in the container"
boot "$WORK/console-1.log" || { tail -20 "$WORK/console-1.log"; die "the container did not boot"; }
BOOTED=$(date +%s)
say "booted in $((BOOTED - PREPARED)) s; installing as jetson/README.md says (no Jetson: no step 2)"
install() {
    x python3 -m venv /opt/edge-server/venv &&
        x /opt/edge-server/venv/bin/pip install -q '/opt/edge-server/src[grpc]' &&
        x ln -sf /opt/edge-server/venv/bin/edge-server /usr/local/bin/edge-server &&
        x edge-server --version &&
        x /opt/edge-server/venv/bin/pip install -q '/opt/edge-server/src[models]' &&
        x edge-server install-service --with-examples
}
install >"$WORK/install.log" 2>&1 || { cat "$WORK/install.log"; die "installing failed"; }
sed 's/^/      /' "$WORK/install.log"
INSTALLED=$(date +%s)
say "installed in $((INSTALLED - BOOTED)) s"
check "install-service created group edge-server-operators" x getent group edge-server-operators
check "the unit names only groups that exist (SupplementaryGroups=)" \
    x sh -c 'for g in $(systemctl show edge-server -P SupplementaryGroups); do getent group "$g" || exit 1; done'
x useradd --create-home --groups edge-server alice
x useradd --create-home --groups edge-server,edge-server-operators bob

# -- first start: notify, STATUS=, journald ---------------------------------------------------------

T=$(date +%s)
check "first start after install: systemctl enable --now returns once ready" x systemctl enable --now edge-server
say "      started in $(($(date +%s) - T)) s; StatusText=$(show StatusText)"
check "active (running), no restart" test "$(show ActiveState)/$(show SubState)/$(show NRestarts)" = active/running/0
check "STATUS= says every model is ready" bash -c "show StatusText | grep -Eq '^serving: ([0-9]+)/\\1 models ready'"
check "journald: MODEL= field on a model's lines" bash -c \
    "x journalctl -u edge-server --no-pager -o cat MODEL=digits | grep -q 'digits v1 ready'"
check "journald: no line at priority err or worse" test -z "$(x journalctl -u edge-server --no-pager -o cat -p err)"
check "a member of edge-server runs a request (infer digits)" bash -c \
    "as alice edge-server infer digits --image /var/lib/edge-server/models/digits/samples/digit_7.png | grep -q '#1: 7'"
check "an operator (edge-server-operators) unloads and loads a model" bash -c \
    "control bob unload && control bob load"
ANSWER=$(control alice unload 2>&1)
if [ $? = 0 ]; then
    say "NOTE  a client (group edge-server only) could unload a model: refused once control is for operators only"
    control bob load >/dev/null 2>&1
else
    check "a client (group edge-server only) cannot unload a model" grep -q -e PERMISSION_DENIED -e PermissionDenied <<<"$ANSWER"
fi

# -- reload ---------------------------------------------------------------------------------------------

x systemctl reload edge-server
# The STATUS= line is rewritten on the daemon's next status tick after READY=1, not with it.
check "systemctl reload: STATUS= notes the reload" wait_until 30 bash -c \
    "show StatusText | grep -q 'last reload .* ok'"

# -- drain on stop -----------------------------------------------------------------------------------

drop slow
check "a hot-dropped model becomes READY" wait_until 60 model_state slow READY
x rm -f /var/lib/edge-server/slow-started
SLOW='import numpy
from edge_server.client import Client
with Client(timeout=60) as client:
    print(client.infer("slow", {"INPUT0": numpy.ones(4, "float32")}))'
(as alice /opt/edge-server/venv/bin/python -c "$SLOW" >"$WORK/slow.out" 2>&1; echo $? >"$WORK/slow.rc") &
INFER=$!
wait_until 30 x test -e /var/lib/edge-server/slow-started || fail "the slow request never started"
T=$(date +%s)
x systemctl stop edge-server
wait "$INFER"
check "stop drains: the request in flight is answered" test "$(cat "$WORK/slow.rc")" = 0
sed 's/^/        /' "$WORK/slow.out"
check "stop drains: the daemon exits cleanly" test "$(show Result)" = success
say "      stopped in $(($(date +%s) - T)) s with a 4 s request in flight"
x rm -rf /var/lib/edge-server/models/slow

# -- stop while a hot-dropped model loads ----------------------------------------------------------------

fresh_start
drop stuck
check "a hot-dropped model whose initialize() takes an hour is LOADING" wait_until 60 model_state stuck LOADING
T=$(date +%s)
x systemctl stop edge-server
STOP_S=$(($(date +%s) - T))
check "stop while loading: exits within its own budget, not killed (took ${STOP_S} s; TimeoutStopSec=60)" \
    test "$(show Result)" = success -a "$STOP_S" -lt 60
check "stop while loading: systemd did not SIGKILL it" bash -c "! journal_since $T | grep -q 'timed out. Killing'"
x rm -rf /var/lib/edge-server/models/stuck

# -- watchdog ------------------------------------------------------------------------------------------------

x mkdir -p /etc/systemd/system/edge-server.service.d
x sh -c 'printf "[Service]\nWatchdogSec=6\n" >/etc/systemd/system/edge-server.service.d/watchdog-test.conf'
x systemctl daemon-reload
fresh_start
PID=$(show MainPID)
T=$(date +%s)
x kill -STOP "$PID"
check "watchdog: a frozen daemon is restarted" wait_until 60 bash -c \
    "test \"\$(show NRestarts)\" -ge 1 -a \"\$(show MainPID)\" != $PID -a \"\$(show ActiveState)\" = active"
check "watchdog: the journal says why" bash -c "journal_since $T | grep -qi 'watchdog timeout'"
say "      restarted $(($(date +%s) - T)) s after SIGSTOP (WatchdogSec=6)"
x rm -rf /etc/systemd/system/edge-server.service.d
x systemctl daemon-reload
x systemctl stop edge-server

# -- a model that fails at start-up ---------------------------------------------------------------------------

drop broken
x systemctl reset-failed edge-server
T=$(date +%s)
x systemctl start edge-server >/dev/null 2>&1 && fail "a start with a broken model succeeded"
check "failed start: the daemon's last log lines name the model" bash -c \
    "daemon_log -n 2 | grep -q 'model broken failed to load'"
check "failed start: systemd gives up after the start limit (StartLimitBurst=5)" wait_until 150 bash -c \
    "test \"\$(show ActiveState)\" = failed && journal_since $T | grep -q 'Start request repeated too quickly'"
say "      gave up $(($(date +%s) - T)) s after the first start"
check "failed start: STATUS= still names the model and why" bash -c \
    "show StatusText | grep -q '^failed: model broken did not load: '"
say "      StatusText=$(show StatusText)"
say "      the daemon's last lines: $(daemon_log -n 2 | tr '\n' '|')"
x rm -rf /var/lib/edge-server/models/broken
check "after the fix: reset-failed and start serve again" fresh_start

# -- start at boot -----------------------------------------------------------------------------------------------

shutdown_container || fail "the container did not power off"
boot "$WORK/console-2.log" || { tail -20 "$WORK/console-2.log"; die "the container did not boot again"; }
check "enabled: running after a reboot" wait_until 120 bash -c 'test "$(show ActiveState)" = active'
say "      $(x systemd-analyze security edge-server --no-pager 2>/dev/null | tail -1)"

# -- uninstall --purge -------------------------------------------------------------------------------------------

x edge-server uninstall-service --purge >"$WORK/uninstall.log" 2>&1
RC=$?
sed 's/^/      /' "$WORK/uninstall.log"
check "uninstall-service --purge exits 0" test "$RC" = 0
check "uninstall --purge: the service is gone" bash -c '! x systemctl cat edge-server >/dev/null 2>&1'
check "uninstall --purge: user edge-server is gone" bash -c '! x getent passwd edge-server'
check "uninstall --purge: group edge-server is gone (alice was in it)" bash -c '! x getent group edge-server'
check "uninstall --purge: group edge-server-operators is gone" bash -c '! x getent group edge-server-operators'
check "uninstall --purge: repository and settings are gone" bash -c \
    '! x test -e /var/lib/edge-server -o -e /etc/edge-server'

shutdown_container || fail "the container did not power off"
END=$(date +%s)
say "prepared in $((PREPARED - STARTED)) s, checks in $((END - PREPARED)) s, $((END - STARTED)) s in all"
if [ "$FAILED" -gt 0 ]; then
    say "test-system: $FAILED check(s) FAILED"
    exit 1
fi
say "test-system: every check passed"
