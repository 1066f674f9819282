// cpu_account.bpf.c: on-CPU time per tenant cgroup (cgroup v2 ids), summed in the kernel.
//
// Hook: tracepoint sched:sched_switch. In sched_switch `current` is still the task being switched
// OUT, so bpf_get_current_*cgroup_id() names the cgroup of the slice that just ended.
// Per CPU we keep when the running slice started and which thread runs it (`cur`); each switch adds
// (now - start) to the outgoing task's tenant in `usage`, then starts the next slice. User space
// (ebpf/programs.py) adds the still-running slices from `cur` when it reads, so a busy loop that is
// never switched out is counted too.
//
// Keys: the id of the task's ancestor cgroup at depth TENANT_LEVEL of the v2 hierarchy
// (bpf_get_current_ancestor_cgroup_id, 5.6+): with tenants at <v2 root>/adapter-gateway/<tenant>,
// TENANT_LEVEL=2 folds a tenant's child cgroups into the tenant. Tasks shallower than that
// (everything outside the tenants: ancestor id 0) and the idle task (pid 0) are not counted.
// The id is the inode number of the cgroup dir.
//
// Cost per context switch: a per-CPU array lookup, a clock read and the cgroup id; plus a per-CPU
// hash lookup/update when the outgoing task is a tenant's. No atomics, no events to user space.
// Constants come in as cflags (-DTENANT_LEVEL=, -DMAX_CGROUPS=).
#include <uapi/linux/ptrace.h>

#ifndef TENANT_LEVEL
#define TENANT_LEVEL 2
#endif
#ifndef MAX_CGROUPS
#define MAX_CGROUPS 4096
#endif

struct slice_t {
    u64 start_ns;   // bpf_ktime_get_ns() (CLOCK_MONOTONIC) when the running slice began; 0 = unknown
    u32 tid;        // thread on CPU since start_ns (0 = idle)
    u32 pad;
};

BPF_PERCPU_ARRAY(cur, struct slice_t, 1);
BPF_PERCPU_HASH(usage, u64, u64, MAX_CGROUPS);

TRACEPOINT_PROBE(sched, sched_switch)
{
    u32 zero = 0;
    struct slice_t *s = cur.lookup(&zero);
    if (!s)
        return 0;
    u64 now = bpf_ktime_get_ns();
    if (s->start_ns && args->prev_pid != 0 && now > s->start_ns) {
        u64 id = bpf_get_current_ancestor_cgroup_id(TENANT_LEVEL);
        if (id) {
            u64 delta = now - s->start_ns;
            u64 *v = usage.lookup(&id);
            if (v)
                *v += delta;        // per-CPU value: no other CPU writes it
            else
                usage.update(&id, &delta);
        }
    }
    s->start_ns = now;
    s->tid = args->next_pid;
    return 0;
}
