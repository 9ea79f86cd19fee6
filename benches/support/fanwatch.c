/* The C peer of the mount_storm bench (--process): fanotify mount events on
 * the caller's mount namespace, statmount(2) of each event's mount id, one
 * JSON line per event on stdout, flushed after each read() of events. The
 * plainest watcher that does the same work as `volring mounts --watch`, so
 * the bench can say what volring's whole process costs against it.
 *
 * A move is counted per fanotify event that carries both ATTACH and DETACH
 * (the kernel's word), not per change of state seen by statmount.
 *
 * Built by the bench with `cc -O2`. Usage: fanwatch [--quiet]
 * Prints "ready" on stderr once marked, counts on SIGTERM/SIGINT.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fanotify.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SYS_statmount_nr 457
#define FAN_REPORT_MNT_ 0x4000
#define FAN_MARK_MNTNS_ 0x110
#define FAN_MNT_ATTACH_ 0x01000000ULL
#define FAN_MNT_DETACH_ 0x02000000ULL
#define FAN_Q_OVERFLOW_ 0x4000ULL
#define INFO_MNT 7

struct mnt_id_req { uint32_t size, spare; uint64_t mnt_id, param; };

static volatile sig_atomic_t stop;
static void on_sig(int s) { (void)s; stop = 1; }

static void put_json_str(FILE *f, const char *s) {
	fputc('"', f);
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\') { fputc('\\', f); fputc(c, f); }
		else if (c < 0x20) fprintf(f, "\\u%04x", c);
		else fputc(c, f);
	}
	fputc('"', f);
}

int main(int argc, char **argv) {
	int quiet = argc > 1 && !strcmp(argv[1], "--quiet");
	struct sigaction sa = { .sa_handler = on_sig }; /* no SA_RESTART: a signal ends read() */
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	int fan = fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_REPORT_MNT_, O_RDONLY);
	if (fan < 0) { perror("fanotify_init"); return 1; }
	int ns = open("/proc/self/ns/mnt", O_RDONLY);
	if (fanotify_mark(fan, FAN_MARK_ADD | FAN_MARK_MNTNS_, FAN_MNT_ATTACH_ | FAN_MNT_DETACH_, ns, NULL) < 0) {
		perror("fanotify_mark"); return 1;
	}
	fprintf(stderr, "ready\n");
	static char buf[64 * 1024];
	static char sm[64 * 1024];
	unsigned long attached = 0, detached = 0, moved = 0, gone = 0, overflows = 0;
	while (!stop) {
		ssize_t n = read(fan, buf, sizeof buf);
		if (n < 0) { if (errno == EINTR) continue; perror("read"); break; }
		for (char *p = buf; p < buf + n;) {
			struct fanotify_event_metadata *m = (void *)p;
			if (m->event_len < sizeof *m || p + m->event_len > buf + n) break;
			if (m->mask & FAN_Q_OVERFLOW_) { overflows++; p += m->event_len; continue; }
			uint64_t id = 0;
			for (char *q = p + m->metadata_len; q + 4 <= p + m->event_len;) {
				uint16_t len = *(uint16_t *)(q + 2);
				if (len < 4) break;
				if ((uint8_t)q[0] == INFO_MNT && len >= 16) memcpy(&id, q + 8, 8);
				q += len;
			}
			int a = !!(m->mask & FAN_MNT_ATTACH_), d = !!(m->mask & FAN_MNT_DETACH_);
			const char *kind = a && d ? "moved" : a ? "attached" : "detached";
			if (a && d) moved++; else if (a) attached++; else detached++;
			struct mnt_id_req req = { sizeof req, 0, id, 0x3ff };
			long rc = syscall(SYS_statmount_nr, &req, sm, sizeof sm, 0);
			if (rc < 0) gone++;
			if (!quiet) {
				printf("{\"event\":\"%s\",\"id\":%llu", kind, (unsigned long long)id);
				if (rc == 0) {
					uint32_t str_mp = *(uint32_t *)(sm + 108), str_src = *(uint32_t *)(sm + 124);
					uint64_t mask = *(uint64_t *)(sm + 8);
					fputs(",\"target\":", stdout);
					put_json_str(stdout, (mask & 0x10) ? sm + 512 + str_mp : "");
					fputs(",\"source\":", stdout);
					put_json_str(stdout, (mask & 0x200) ? sm + 512 + str_src : "none");
				}
				fputs("}\n", stdout);
			}
			p += m->event_len;
		}
		if (!quiet) fflush(stdout);
	}
	fprintf(stderr, "attached %lu detached %lu moved %lu gone %lu overflows %lu\n", attached, detached, moved, gone, overflows);
	return 0;
}
