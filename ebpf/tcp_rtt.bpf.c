// tcp_rtt.bpf.c: log2 histogram of the smoothed RTT (srtt, microseconds) per remote address and port.
//
// Hook: tracepoint tcp:tcp_probe (4.16+), fired for every segment an established socket receives
// (tcp_rcv_established); its `srtt` field is already in microseconds (tp->srtt_us >> 3) and
// `daddr`/`dport` are the remote end (a sockaddr_in or sockaddr_in6 in 28 bytes; dport in host
// order). IPv4 and IPv6; other families are ignored.
//
// Filter: with FILTER_PORTS=1 only sockets whose remote port is a key of `ports` are counted (user
// space fills it with the upstream ports), so the cost on unrelated traffic is one hash lookup.
// Slot: bpf_log2l(srtt): slot 0 holds 0 us, slot i >= 1 holds [2^(i-1), 2^i) us.
// `stats` keeps count, sum and the last srtt per remote for means without a histogram walk.
//
// Cost: per received segment on a matching socket, one hash increment and one hash update.
// Constants come in as cflags (-DFILTER_PORTS=, -DMAX_REMOTES=).
#include <uapi/linux/ptrace.h>
#include <linux/socket.h>

#ifndef FILTER_PORTS
#define FILTER_PORTS 1
#endif
#ifndef MAX_REMOTES
#define MAX_REMOTES 1024
#endif

struct remote_t {
    u8 addr[16];    // IPv4: first 4 bytes, rest zero
    u16 port;
    u16 family;     // AF_INET (2) or AF_INET6 (10)
    u32 pad;
};

struct hist_key_t {
    struct remote_t remote;
    u64 slot;
};

struct stats_t {
    u64 count;
    u64 sum_us;
    u64 last_us;
};

BPF_HASH(ports, u16, u8, 256);
BPF_HISTOGRAM(hist, struct hist_key_t, MAX_REMOTES * 32);
BPF_HASH(stats, struct remote_t, struct stats_t, MAX_REMOTES);

TRACEPOINT_PROBE(tcp, tcp_probe)
{
    u16 dport = args->dport;
#if FILTER_PORTS
    if (!ports.lookup(&dport))
        return 0;
#endif
    struct hist_key_t key = {};
    u16 family = args->family;
    if (family == AF_INET) {
        // struct sockaddr_in: family(2) port(2) addr(4)
        bpf_probe_read_kernel(&key.remote.addr, 4, (void *)args->daddr + 4);
    } else if (family == AF_INET6) {
        // struct sockaddr_in6: family(2) port(2) flowinfo(4) addr(16)
        bpf_probe_read_kernel(&key.remote.addr, 16, (void *)args->daddr + 8);
    } else {
        return 0;
    }
    key.remote.port = dport;
    key.remote.family = family;
    u64 srtt = args->srtt;
    key.slot = bpf_log2l(srtt);
    hist.atomic_increment(key);

    struct stats_t zero = {};
    struct stats_t *st = stats.lookup_or_try_init(&key.remote, &zero);
    if (st) {
        __sync_fetch_and_add(&st->count, 1);
        __sync_fetch_and_add(&st->sum_us, srtt);
        st->last_us = srtt;
    }
    return 0;
}
