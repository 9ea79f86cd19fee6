// What does a WRITE payload cost the receiving thread, by path?
//
// A sender process streams fixed-size payloads over a unix socketpair or a
// TCP loopback connection; the receiver takes each payload into a file in
// the page cache and measures its own thread CPU time per payload:
//   recv    recv(MSG_WAITALL) into a buffer, nothing else (the receive copy)
//   pwrite  pwrite from a buffer, no socket (the file system's buffered write)
//   copy    recv into a buffer, then pwrite (what a copying server does)
//   splice  blocking splice(socket -> pipe) then splice(pipe -> file) on the
//           same thread, the pipe sized to the payload with F_SETPIPE_SZ (at least the
//           default 64 KiB), each piece drained before the next is taken
//   splice1 the same with the whole payload taken into the pipe first and
//           written out by one splice (pipe sized to twice the payload, as
//           a payload's socket fragments can need more slots than its pages;
//           without CAP_SYS_RESOURCE at most fs.pipe-max-size, then a
//           payload that needs more slots than that hangs: run it under
//           timeout)
// Modes run interleaved round by round; the median per mode is printed with
// its ratio to `copy`.
//
// cc -O2 -o splicewrite benches/support/splicewrite.c
// ./splicewrite DIR unix|tcp PAYLOAD_BYTES MIB_PER_RUN ROUNDS [RECV_CPU SEND_CPU [MODE]]
// (MODE: run only that one, e.g. to profile it with perf record -g)
// DIR is a directory on the file system under test (a loop-mounted ext4 or
// xfs); a 256 MiB file is made there, written once, and removed at the end.

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FILE_SIZE (256ull << 20)

static char path[4096];  // the file under test, removed on the way out

static void die(const char *what) {
    perror(what);
    if (path[0]) unlink(path);
    exit(1);
}

static double thread_cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (sched_setaffinity(0, sizeof s, &s)) die("sched_setaffinity");
}

// A connected pair: fds[0] the receiver's end, fds[1] the sender's.
static void connect_pair(const char *kind, int fds[2]) {
    if (!strcmp(kind, "unix")) {
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds)) die("socketpair");
        return;
    }
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t n = sizeof a;
    if (l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, 1) || getsockname(l, (void *)&a, &n)) die("listen");
    fds[1] = socket(AF_INET, SOCK_STREAM, 0);
    if (fds[1] < 0 || connect(fds[1], (void *)&a, sizeof a)) die("connect");
    fds[0] = accept(l, NULL, NULL);
    if (fds[0] < 0) die("accept");
    close(l);
    int one = 1;
    setsockopt(fds[1], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Sends `count` payloads of `size` bytes, then exits.
static void sender(int fd, size_t size, uint64_t count, int cpu) {
    pin(cpu);
    char *buf = malloc(size);
    memset(buf, 0x5a, size);
    for (uint64_t i = 0; i < count; i++) {
        size_t done = 0;
        while (done < size) {
            ssize_t w = send(fd, buf + done, size - done, 0);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) _exit(2);
            done += w;
        }
    }
    _exit(0);
}

// Where payload i lands: sequential for large payloads, scattered for small
// ones (as fio's randwrite), always inside the cached file.
static off_t place(uint64_t i, size_t size) {
    uint64_t slots = FILE_SIZE / size;
    uint64_t slot = size >= (128 << 10) ? i % slots : (i * 2654435761u) % slots;
    return (off_t)(slot * size);
}

static void recv_all(int fd, char *buf, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t r = recv(fd, buf + done, size - done, MSG_WAITALL);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) die("recv");
        done += r;
    }
}

static void pwrite_all(int fd, const char *buf, size_t size, off_t off) {
    size_t done = 0;
    while (done < size) {
        ssize_t w = pwrite(fd, buf + done, size - done, off + done);
        if (w <= 0) die("pwrite");
        done += w;
    }
}

// One payload through the pipe: socket -> pipe, then pipe -> file, until
// it is all written. Blocking, on this thread. Whatever one splice in moved
// is drained before the next: a payload's socket fragments need not fill
// whole pages, so it can take more pipe slots than its size in pages and a
// pipe sized to the payload can be full before the payload is all in.
static void splice_one(int sock, int pr, int pw, int file, size_t size, off_t off) {
    loff_t o = off;
    size_t done = 0;
    while (done < size) {
        ssize_t r = splice(sock, NULL, pw, NULL, size - done, SPLICE_F_MOVE);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) die("splice socket->pipe");
        size_t out = 0;
        while (out < (size_t)r) {
            ssize_t w = splice(pr, NULL, file, &o, (size_t)r - out, SPLICE_F_MOVE);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) die("splice pipe->file");
            out += w;
        }
        done += r;
    }
}

// The whole payload into the pipe, then out to the file.
static void splice_whole(int sock, int pr, int pw, int file, size_t size, off_t off) {
    size_t in = 0;
    while (in < size) {
        ssize_t r = splice(sock, NULL, pw, NULL, size - in, SPLICE_F_MOVE);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) die("splice socket->pipe");
        in += r;
    }
    loff_t o = off;
    size_t out = 0;
    while (out < size) {
        ssize_t w = splice(pr, NULL, file, &o, size - out, SPLICE_F_MOVE);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("splice pipe->file");
        out += w;
    }
}

enum mode { RECV, PWRITE, COPY, SPLICE, SPLICE1, MODES };
static const char *names[MODES] = {"recv", "pwrite", "copy", "splice", "splice1"};

// CPU seconds per payload of one run of `mode`.
static double run(enum mode m, const char *kind, int file, size_t size, uint64_t count, int rcpu, int scpu) {
    char *buf = aligned_alloc(4096, size);
    memset(buf, 0xa5, size);
    int fds[2] = {-1, -1}, pipefd[2] = {-1, -1};
    pid_t child = -1;
    if (m != PWRITE) {
        connect_pair(kind, fds);
        child = fork();
        if (child < 0) die("fork");
        if (child == 0) {
            close(fds[0]);
            sender(fds[1], size, count, scpu);
        }
        close(fds[1]);
    }
    if (m == SPLICE || m == SPLICE1) {
        if (pipe(pipefd)) die("pipe");
        size_t want = m == SPLICE1 ? 2 * size : size;
        if (want < 65536) want = 65536;
        if (fcntl(pipefd[1], F_SETPIPE_SZ, (int)want) < (int)want && (want = size < 65536 ? 65536 : size) &&
            fcntl(pipefd[1], F_SETPIPE_SZ, (int)want) < (int)want)
            die("F_SETPIPE_SZ");
    }
    pin(rcpu);
    double t0 = thread_cpu();
    for (uint64_t i = 0; i < count; i++) {
        off_t off = place(i, size);
        switch (m) {
        case RECV: recv_all(fds[0], buf, size); break;
        case PWRITE: pwrite_all(file, buf, size, off); break;
        case COPY:
            recv_all(fds[0], buf, size);
            pwrite_all(file, buf, size, off);
            break;
        case SPLICE: splice_one(fds[0], pipefd[0], pipefd[1], file, size, off); break;
        case SPLICE1: splice_whole(fds[0], pipefd[0], pipefd[1], file, size, off); break;
        default: break;
        }
    }
    double per = (thread_cpu() - t0) / count;
    if (child > 0) {
        int st;
        waitpid(child, &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "sender failed\n");
            exit(1);
        }
        close(fds[0]);
    }
    if (pipefd[0] >= 0) close(pipefd[0]), close(pipefd[1]);
    free(buf);
    return per;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s DIR unix|tcp PAYLOAD_BYTES MIB_PER_RUN ROUNDS [RECV_CPU SEND_CPU]\n", argv[0]);
        return 2;
    }
    const char *kind = argv[2];
    size_t size = strtoull(argv[3], NULL, 0);
    uint64_t count = (strtoull(argv[4], NULL, 0) << 20) / size;
    int rounds = atoi(argv[5]);
    int rcpu = argc > 7 ? atoi(argv[6]) : -1, scpu = argc > 7 ? atoi(argv[7]) : -1;
    const char *only = argc > 8 ? argv[8] : NULL;
    if (rounds < 1 || rounds > 64 || !count || size > (1 << 20)) return 2;
    signal(SIGPIPE, SIG_IGN);
    snprintf(path, sizeof path, "%s/splicewrite.%d", argv[1], getpid());
    int file = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (file < 0) die("open");
    // Written once, so every run overwrites cached pages of an allocated file.
    char *fill = malloc(1 << 20);
    memset(fill, 0x11, 1 << 20);
    for (off_t o = 0; o < (off_t)FILE_SIZE; o += 1 << 20) pwrite_all(file, fill, 1 << 20, o);
    fsync(file);
    free(fill);
    double r[MODES][64];
    for (int k = 0; k < rounds; k++)
        for (int j = 0; j < MODES; j++) {
            int m = (j + k) % MODES;  // rotate the order round by round
            r[m][k] = only && strcmp(only, names[m]) ? 0 : run(m, kind, file, size, count, rcpu, scpu);
        }
    double med[MODES];
    for (int m = 0; m < MODES; m++) {
        qsort(r[m], rounds, sizeof(double), cmp);
        med[m] = r[m][rounds / 2];
    }
    printf("%s %s payload %zu B, %llu per run, %d rounds, receiver thread CPU per payload (median):\n", argv[1], kind, size,
           (unsigned long long)count, rounds);
    for (int m = 0; m < MODES; m++)
        if (med[m] > 0 && med[COPY] > 0) printf("  %-7s %9.2f us  (%.2fx copy)\n", names[m], med[m] * 1e6, med[m] / med[COPY]);
        else if (med[m] > 0) printf("  %-7s %9.2f us\n", names[m], med[m] * 1e6);
    close(file);
    unlink(path);
    return 0;
}
