#!/usr/bin/env bash
# setup-ebpf.sh: install what the ebpf/ package needs to load its BCC programs, idempotently.
#
#   - Debian python3-bpfcc + bpfcc-tools (BCC's Python bindings; PyPI `bcc` is an unrelated project)
#   - flatbuffers-compiler (flatc; only to check ebpf/snapshot_fb/ against ebpf/snapshot.fbs)
#   - kernel headers BCC can compile against. Kernels without a matching linux-headers package
#     (e.g. the 6.18 Firecracker kernel here, which ships none and has no CONFIG_IKHEADERS) get
#     Debian's linux-headers-6.1.0-*-cloud-amd64 + -common, linked as /lib/modules/$(uname -r)/build
#     and /source. The programs only use tracepoints (their layout is read from tracefs at load time)
#     and BPF helpers, so a header set of another version is enough for them.
#   - tracefs mounted at /sys/kernel/tracing (and debugfs at /sys/kernel/debug, which BCC also probes)
#
# Run as root (make does). Where it cannot do its job (not root, no apt-get) it prints ONE line saying
# so and exits 0: the agent then falls back to polling cgroup counters, and the ebpf tests skip with
# a reason. Safe to run again: every step checks first and does nothing when already done.
set -u

say() { echo "setup-ebpf: $*"; }

if [ "$(id -u)" != 0 ]; then
    say "not root; skipping BCC/headers/tracefs setup (eBPF tests will skip, the agent will poll cgroup counters)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-query >/dev/null 2>&1; then
    say "no apt-get/dpkg (not Debian-like); skipping BCC setup (the agent will poll cgroup counters)"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
KREL="$(uname -r)"
changed=0
updated=0

installed() {  # installed PKG -> 0 when dpkg says it is installed
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'
}

apt_update_once() {
    if [ "$updated" = 0 ]; then
        apt-get update -qq >/dev/null 2>&1 || say "apt-get update failed (continuing with cached lists)"
        updated=1
    fi
    return 0
}

apt_install() {  # apt_install PKG... ; installs only what is missing
    local missing=()
    for p in "$@"; do installed "$p" || missing+=("$p"); done
    [ "${#missing[@]}" = 0 ] && return 0
    apt_update_once
    say "installing ${missing[*]}"
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
        say "apt-get install ${missing[*]} failed"
        return 1
    fi
    changed=1
}

rc=0
apt_install python3-bpfcc bpfcc-tools flatbuffers-compiler || rc=1

# --- kernel headers -------------------------------------------------------------------------------
build="/lib/modules/$KREL/build"
headers_ok() {  # Debian splits headers: arch part (build) and common part (source)
    [ -e "$build/include/generated/autoconf.h" ] && \
        { [ -e "$build/include/linux/kconfig.h" ] || [ -e "/lib/modules/$KREL/source/include/linux/kconfig.h" ]; }
}
if headers_ok || [ -e /sys/kernel/kheaders.tar.xz ]; then
    :  # headers already usable (ours from an earlier run, the distro's, or CONFIG_IKHEADERS)
else
    hdr=""
    # A matching Debian headers package first (a stock Debian kernel).
    if [ -d "/usr/src/linux-headers-$KREL" ]; then
        hdr="/usr/src/linux-headers-$KREL"
    elif apt_update_once && apt-cache show "linux-headers-$KREL" >/dev/null 2>&1; then
        apt_install "linux-headers-$KREL" && hdr="/usr/src/linux-headers-$KREL"
    fi
    if [ -z "$hdr" ]; then
        # 6.1 cloud headers installed by an earlier run (only the links are missing: no download).
        have="$(ls -d /usr/src/linux-headers-6.1.0-*-cloud-amd64 2>/dev/null | sort -V | tail -1)"
        [ -n "$have" ] && [ -d "${have%-cloud-amd64}-common" ] && hdr="$have"
    fi
    if [ -z "$hdr" ]; then
        # Otherwise the newest 6.1 cloud headers Debian has (and their -common, pulled as a dependency).
        pkg="$(apt-cache search --names-only '^linux-headers-6\.1\.0-[0-9]+-cloud-amd64$' 2>/dev/null \
               | awk '{print $1}' | sort -V | tail -1)"
        if [ -n "$pkg" ]; then
            ver="${pkg#linux-headers-}"              # 6.1.0-NN-cloud-amd64
            common="linux-headers-${ver%-cloud-amd64}-common"
            apt_install "$pkg" "$common" && hdr="/usr/src/$pkg"
        else
            say "no linux-headers-6.1.0-*-cloud-amd64 package found"
        fi
    fi
    if [ -n "$hdr" ] && [ -d "$hdr" ]; then
        mkdir -p "/lib/modules/$KREL"
        ln -sfn "$hdr" "$build"
        # -common holds the arch-independent half; bcc looks for it through ./source.
        src="$(readlink -f "$hdr/../$(basename "$hdr" | sed 's/-cloud-amd64$/-common/')" 2>/dev/null)"
        [ -n "$src" ] && [ -d "$src" ] || src="$hdr"
        ln -sfn "$src" "/lib/modules/$KREL/source"
        changed=1
    else
        rc=1
    fi
fi
# A links-only repair (packages present, links lost, e.g. a new kernel release on the same disk).
if [ ! -e "/lib/modules/$KREL/source" ] && [ -e "$build" ]; then
    ln -sfn "$(readlink -f "$build")" "/lib/modules/$KREL/source"; changed=1
fi

# --- tracefs / debugfs ----------------------------------------------------------------------------
if [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null && changed=1 \
        || { say "could not mount tracefs at /sys/kernel/tracing"; rc=1; }
fi
if [ -d /sys/kernel/debug ] && ! mountpoint -q /sys/kernel/debug; then
    mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null && changed=1 || true
fi

if [ "$rc" != 0 ]; then
    say "incomplete (see above); eBPF may not load, the agent will fall back to polling cgroup counters"
elif [ "$changed" = 1 ]; then
    say "ready (BCC $(dpkg-query -W -f='${Version}' python3-bpfcc), headers $(readlink -f "$build"), tracefs mounted)"
else
    say "already set up"
fi
exit 0
