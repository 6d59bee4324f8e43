/*
 * gatewayd-launcher: the step between gatewayd and bubblewrap for one sandboxed command.
 *
 * Why a program of its own and not Python in the forked child (a preexec_fn): a
 * preexec_fn forces a full fork of the daemon (its page tables copied, every page the
 * child's interpreter touches copied on write, Python's after-fork hooks run, the copy
 * torn down again at exec): 8-13 ms per command here. gatewayd instead starts this small
 * program with vfork and exec (subprocess without a preexec_fn), and it makes the same
 * system calls in the same order, then execs bwrap in the same process:
 *
 *   1. join the command's cgroup (write "0" to each file named: v1 `tasks`, v2
 *      `cgroup.procs`), first, so bwrap and everything it starts are counted;
 *   2. join the run's network namespace (setns, CAP_SYS_ADMIN);
 *   3. attach the pinned directories: a detached copy of each pinned directory's mount
 *      is made while still in the daemon's mount namespace (open_tree), then a private
 *      mount namespace, where nothing mounted reaches the host, gets each copy at its
 *      run-private mount point (move_mount);
 *   4. set the rlimits;
 *   5. drop to the run's unprivileged uid/gid with no supplementary group and no
 *      capability in any set (from a non-root gatewayd with ambient capabilities the uid
 *      change alone clears nothing);
 *   6. set no_new_privs, then the parent-death signal (after the uid change, which
 *      clears it), and check gatewayd is still its parent (else no signal would come);
 *      the signal stays across the exec of bwrap, which is not set-uid;
 *   7. exec bwrap with the environment it was given (gatewayd gives an empty one).
 *
 * Every descriptor given for steps 2 and 3 is closed before the exec: bwrap and the
 * command never hold the run's namespace or a host directory. The report descriptor is
 * close-on-exec: gatewayd reads end-of-file when bwrap started, or one line "STEP:
 * [Errno N] REASON" when a step failed, after which this program exits with status 127
 * and nothing was started.
 *
 * Usage (gatewayd's own; not a command for people):
 *
 *   gatewayd-launcher REPORT_FD NETNS_FD UID GID
 *                     N_JOINS [JOIN_FILE]...
 *                     N_PINS [PIN_FD MOUNT_POINT]...
 *                     N_LIMITS [RESOURCE SOFT HARD]...
 *                     PROGRAM [ARG]...
 *
 * NETNS_FD -1 keeps the network namespace (the start-up probe's use). The arguments come
 * from gatewayd, never from a run; they are still checked, and a bad one fails the
 * launch before anything is done.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

#define EXIT_LAUNCH_FAILED 127

static int report_fd = -1;

/* Say which step failed and why, on the report descriptor (stderr before it is known),
 * and exit: nothing was started. */
__attribute__((noreturn)) static void fail(const char *step, int err) {
    char line[512];
    int n = snprintf(line, sizeof line, "%s: [Errno %d] %s", step, err, strerror(err));
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof line) n = sizeof line - 1;
    int fd = report_fd >= 0 ? report_fd : 2;
    const char *p = line;
    while (n > 0) {
        ssize_t w = write(fd, p, (size_t)n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        p += w;
        n -= (int)w;
    }
    _exit(EXIT_LAUNCH_FAILED);
}

static const char *const READ_ARGUMENTS = "read its arguments";

/* A whole decimal number in [lo, hi], else the launch fails. */
static long long number(const char *text, long long lo, long long hi) {
    if (text == NULL || !(*text == '-' || (*text >= '0' && *text <= '9')))
        fail(READ_ARGUMENTS, EINVAL);
    errno = 0;
    char *end = NULL;
    long long value = strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || value < lo || value > hi)
        fail(READ_ARGUMENTS, EINVAL);
    return value;
}

/* An unsigned decimal rlimit value (no sign, no infinity: gatewayd's limits are finite). */
static rlim_t limit_value(const char *text) {
    if (text == NULL || *text < '0' || *text > '9') fail(READ_ARGUMENTS, EINVAL);
    errno = 0;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0' || value >= (unsigned long long)RLIM_INFINITY)
        fail(READ_ARGUMENTS, EINVAL);
    return (rlim_t)value;
}

static int descriptor(const char *text) { return (int)number(text, 0, INT_MAX); }

int main(int argc, char **argv) {
    /* gatewayd: if it is gone by the time the parent-death signal is set, nothing would
     * ever send that signal. */
    pid_t parent = getppid();
    int at = 1;
#define NEXT() (at < argc ? argv[at++] : NULL)
    report_fd = (int)number(NEXT(), 0, INT_MAX);
    if (fcntl(report_fd, F_SETFD, FD_CLOEXEC) != 0) {
        int err = errno;
        report_fd = -1;
        fail(READ_ARGUMENTS, err);
    }
    int netns_fd = (int)number(NEXT(), -1, INT_MAX);
    uid_t uid = (uid_t)number(NEXT(), 1, 4294967294LL);
    gid_t gid = (gid_t)number(NEXT(), 1, 4294967294LL);

    long long n_joins = number(NEXT(), 0, 16);
    char **joins = argv + at;
    for (long long i = 0; i < n_joins; i++)
        if (NEXT() == NULL) fail(READ_ARGUMENTS, EINVAL);

    /* A run pins its workspace and each policy path outside it: no fixed bound but the
     * command line's own (two arguments a pin). */
    const char *count = NEXT();
    long long n_pins = number(count, 0, (argc - at) / 2);
    int *pin_fds = calloc((size_t)n_pins + 1, sizeof *pin_fds);
    int *trees = calloc((size_t)n_pins + 1, sizeof *trees);
    const char **points = calloc((size_t)n_pins + 1, sizeof *points);
    if (pin_fds == NULL || trees == NULL || points == NULL) fail(READ_ARGUMENTS, ENOMEM);
    for (long long i = 0; i < n_pins; i++) {
        pin_fds[i] = descriptor(NEXT());
        points[i] = NEXT();
        if (points[i] == NULL || points[i][0] != '/') fail(READ_ARGUMENTS, EINVAL);
    }

    long long n_limits = number(NEXT(), 0, RLIM_NLIMITS);
    int resources[RLIM_NLIMITS];
    struct rlimit values[RLIM_NLIMITS];
    for (long long i = 0; i < n_limits; i++) {
        resources[i] = (int)number(NEXT(), 0, RLIM_NLIMITS - 1);
        values[i].rlim_cur = limit_value(NEXT());
        values[i].rlim_max = limit_value(NEXT());
    }

    if (at >= argc || argv[at][0] != '/') fail(READ_ARGUMENTS, EINVAL);
    char **program = argv + at;
#undef NEXT

    for (long long i = 0; i < n_joins; i++) {
        int fd = open(joins[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0) fail("join the command's cgroup", errno);
        if (write(fd, "0", 1) != 1) fail("join the command's cgroup", errno);
        close(fd);
    }

    if (netns_fd >= 0) {
        if (setns(netns_fd, CLONE_NEWNET) != 0) fail("join the run's network namespace", errno);
        close(netns_fd);
    }

    if (n_pins > 0) {
        const char *step = "attach the pinned directories";
        for (long long i = 0; i < n_pins; i++) {
            long tree = syscall(SYS_open_tree, pin_fds[i], "",
                                OPEN_TREE_CLONE | O_CLOEXEC | AT_EMPTY_PATH | AT_RECURSIVE);
            if (tree < 0) fail(step, errno);
            trees[i] = (int)tree;
            close(pin_fds[i]);
        }
        if (unshare(CLONE_NEWNS) != 0) fail(step, errno);
        if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) != 0) fail(step, errno);
        for (long long i = 0; i < n_pins; i++) {
            if (syscall(SYS_move_mount, trees[i], "", AT_FDCWD, points[i],
                        MOVE_MOUNT_F_EMPTY_PATH) != 0)
                fail(step, errno);
            close(trees[i]);
        }
    }

    for (long long i = 0; i < n_limits; i++)
        if (setrlimit(resources[i], &values[i]) != 0) fail("set the rlimits", errno);

    const char *drop = "drop to the run's uid and every capability";
    if (setgroups(0, NULL) != 0) fail(drop, errno);
    if (setresgid(gid, gid, gid) != 0) fail(drop, errno);
    if (setresuid(uid, uid, uid) != 0) fail(drop, errno);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0) fail(drop, errno);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct none[_LINUX_CAPABILITY_U32S_3];
    memset(none, 0, sizeof none);
    if (syscall(SYS_capset, &header, none) != 0) fail(drop, errno);

    const char *privs = "set no_new_privs and the parent-death signal";
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail(privs, errno);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) fail(privs, errno);
    if (getppid() != parent) fail(privs, ESRCH);

    execv(program[0], program);
    fail("execute it", errno);
}
