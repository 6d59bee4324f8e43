/* files.write: write a text file beneath the workspace's out/ directory.
 *
 * Capability: out/, read-write (the manifest's `filesystem` need "out"). The runner
 * preopens /workspace/out (only that: the rest of the workspace does not exist for the
 * module), writable only when the run grants it read-write. The file is replaced
 * atomically (a temporary file beside it, then a rename), or appended to; missing
 * directories beneath out/ are made. */
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cogni_tool.h"

/* What out/ is called inside the module (its preopen). */
#define OUT "/workspace/out"
#define MAX_PATH_BYTES 4096
/* Random bytes in a temporary file's name: concurrent calls never share one. */
#define TEMP_RANDOM_BYTES 8

static void write_all(int fd, const char *data, size_t len, const char *path) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            ct_die(CT_EXIT_FAILED, "%s: %s", path, strerror(errno));
        }
        data += n;
        len -= (size_t)n;
    }
}

/* OUT joined with `rel`, each directory on the way made (0755); returns the offset of the
 * last component's name in `out`. An absolute path, "..", or a path naming no file ends
 * the call. */
static size_t prepare_path(char *out, const char *rel) {
    if (rel[0] == '/') ct_die(CT_EXIT_BAD_INPUT, "\"path\" must be relative to out/");
    if (rel[0] == '\0' || rel[strlen(rel) - 1] == '/')
        ct_die(CT_EXIT_BAD_INPUT, "\"path\" must name a file beneath out/");
    size_t len = strlen(OUT), name_at = 0;
    memcpy(out, OUT, len + 1);
    for (const char *p = rel; *p;) {
        const char *slash = strchr(p, '/');
        size_t n = slash ? (size_t)(slash - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.')
            ct_die(CT_EXIT_BAD_INPUT, "\"path\" may not contain \"..\"");
        if (n > 0 && !(n == 1 && p[0] == '.')) {
            if (name_at != 0 && mkdir(out, 0755) != 0 && errno != EEXIST)
                ct_die(CT_EXIT_FAILED, "%s: %s", out, strerror(errno));
            if (len + 1 + n + 1 > MAX_PATH_BYTES) ct_die(CT_EXIT_BAD_INPUT, "\"path\" is too long");
            out[len++] = '/';
            name_at = len;
            memcpy(out + len, p, n);
            len += n;
            out[len] = '\0';
        }
        p += n + (slash ? 1 : 0);
    }
    if (name_at == 0)
        ct_die(CT_EXIT_BAD_INPUT, "\"path\" must name a file beneath out/");
    return name_at;
}

int main(void) {
    ct_value args = ct_read_arguments("files.write");
    const char *rel = ct_string_arg(args, "path", 1, NULL);
    size_t len;
    const char *content = ct_string_arg(args, "content", 1, &len);
    int append = ct_bool_arg(args, "append", 0);
    static char path[MAX_PATH_BYTES], temp[MAX_PATH_BYTES + 64];
    size_t name_at = prepare_path(path, rel);
    if (append) {
        /* O_NONBLOCK: a FIFO planted under that name must not block the call. */
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_NONBLOCK, 0644);
        if (fd < 0) ct_die(CT_EXIT_FAILED, "%s: %s", path, strerror(errno));
        struct stat st;
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
            ct_die(CT_EXIT_FAILED, "%s: not a regular file", path);
        write_all(fd, content, len, path);
        if (close(fd) != 0) ct_die(CT_EXIT_FAILED, "%s: %s", path, strerror(errno));
    } else {
        unsigned char random[TEMP_RANDOM_BYTES];
        if (getentropy(random, sizeof random) != 0)
            ct_die(CT_EXIT_FAILED, "no random bytes for a temporary name");
        int made = snprintf(temp, sizeof temp, "%.*s.%s.", (int)name_at, path, path + name_at);
        for (size_t i = 0; i < sizeof random && made > 0; i++)
            made += snprintf(temp + made, sizeof temp - (size_t)made, "%02x", random[i]);
        int fd = open(temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644);
        if (fd < 0) ct_die(CT_EXIT_FAILED, "%s: %s", path, strerror(errno));
        write_all(fd, content, len, path);
        if (close(fd) != 0 || rename(temp, path) != 0) {
            int saved = errno;
            unlink(temp);
            ct_die(CT_EXIT_FAILED, "%s: %s", path, strerror(saved));
        }
    }
    printf("{\"path\": ");
    ct_put_string(stdout, path, strlen(path));
    printf(", \"bytes\": %zu, \"appended\": %s}", len, append ? "true" : "false");
    ct_finish();
}
