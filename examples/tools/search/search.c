/* files.search: the lines holding a literal string, in the files beneath the workspace's
 * src/ directory.
 *
 * Capability: src/, read-only (the manifest's `filesystem` need "src"). The run's policy
 * must grant it; the runner then preopens /workspace/src read-only, and nothing else
 * exists for the module (a tool is never handed the whole workspace: it holds the apps
 * folder, which no tool reaches). The walk is bounded (CT constants below): results, files looked
 * at, file size, depth and the text shown per line, so a huge tree or file costs a known
 * amount; `truncated` says when a bound stopped it. Symbolic links are not followed (the
 * runner's preopen keeps any that leads out unreachable anyway), and files holding a NUL
 * byte in their first block are taken as binary and skipped. */
#define _GNU_SOURCE /* memmem */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cogni_tool.h"

/* What src/ is called inside the module (its preopen). */
#define ROOT "/workspace/src"
/* Results per call: the caller reads them in one answer (max_results may lower it). */
#define MAX_RESULTS 1000
#define DEFAULT_RESULTS 100
/* Files looked at per call, and the largest read: a search of a tree, not of a disk. */
#define MAX_FILES 20000
#define MAX_FILE_BYTES ((size_t)4 << 20)
/* Directory depth below the searched path: deeper trees are not walked. */
#define MAX_DEPTH 32
/* A matching line is shown up to this many bytes (cut on a character boundary). */
#define MAX_LINE_SHOWN 240
/* Longest query: a literal, not a document. */
#define MAX_QUERY_BYTES 1000
/* Path buffer: ROOT, the argument and MAX_DEPTH names. */
#define MAX_PATH_BYTES 4096
/* How much of a file is looked at for a NUL byte to call it binary (as git and grep do). */
#define BINARY_PROBE_BYTES 8000

static const char *query;
static size_t query_len;
static long long max_results;
static long long found;
static long long files_seen;
static long long skipped_large;
static int truncated;
static int first_result = 1;

static void report(const char *path, long long line, const char *text, size_t len) {
    if (found >= max_results) {
        truncated = 1;
        return;
    }
    found++;
    size_t shown = len;
    if (shown > MAX_LINE_SHOWN) {
        shown = MAX_LINE_SHOWN;
        while (shown > 0 && (((unsigned char)text[shown]) & 0xC0) == 0x80) shown--;
    }
    printf("%s{\"path\": ", first_result ? "" : ", ");
    first_result = 0;
    ct_put_string(stdout, path, strlen(path));
    printf(", \"line\": %lld, \"text\": ", line);
    ct_put_string(stdout, text, shown);
    printf("%s}", shown < len ? ", \"cut\": true" : "");
}

static void search_file(const char *path, off_t size) {
    if ((size_t)size > MAX_FILE_BYTES) {
        skipped_large++;
        return;
    }
    /* O_NONBLOCK: a file swapped for a FIFO since lstat must not block the call. */
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return; /* gone or unreadable since it was listed: nothing to report */
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return;
    }
    char *data = ct_alloc((size_t)size + 1);
    size_t len = 0;
    while (len < (size_t)size) {
        ssize_t n = read(fd, data + len, (size_t)size - len);
        if (n <= 0) break; /* shrank meanwhile: search what was read */
        len += (size_t)n;
    }
    close(fd);
    if (memchr(data, '\0', len < BINARY_PROBE_BYTES ? len : BINARY_PROBE_BYTES) == NULL) {
        long long line = 1;
        const char *start = data, *end = data + len;
        while (start < end && !truncated) {
            const char *nl = memchr(start, '\n', (size_t)(end - start));
            const char *stop = nl ? nl : end;
            if (memmem(start, (size_t)(stop - start), query, query_len) != NULL)
                report(path, line, start, (size_t)(stop - start));
            line++;
            start = stop + 1;
        }
    }
    free(data);
}

static void walk(char *path, size_t path_len, int depth) {
    DIR *dir = opendir(path);
    if (dir == NULL) return;
    struct dirent *entry;
    while (!truncated && (entry = readdir(dir)) != NULL) {
        const char *name = entry->d_name;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0) continue;
        size_t name_len = strlen(name);
        if (path_len + 1 + name_len + 1 > MAX_PATH_BYTES) continue;
        path[path_len] = '/';
        memcpy(path + path_len + 1, name, name_len + 1);
        struct stat st;
        if (lstat(path, &st) == 0) {
            if (S_ISDIR(st.st_mode)) {
                if (depth < MAX_DEPTH) walk(path, path_len + 1 + name_len, depth + 1);
            } else if (S_ISREG(st.st_mode)) {
                if (++files_seen > MAX_FILES) truncated = 1;
                else search_file(path, st.st_size);
            }
        }
        path[path_len] = '\0';
    }
    closedir(dir);
}

/* ROOT joined with the src-relative `rel` in `out` (MAX_PATH_BYTES), its
 * components normalized ("", "." dropped); returns the length. An absolute path or ".."
 * ends the call: the preopen would refuse the escape anyway, and this says so first. */
static size_t join_root(char *out, const char *rel) {
    if (rel[0] == '/') ct_die(CT_EXIT_BAD_INPUT, "\"path\" must be relative to src/");
    size_t len = strlen(ROOT);
    memcpy(out, ROOT, len + 1);
    for (const char *p = rel; *p;) {
        const char *slash = strchr(p, '/');
        size_t n = slash ? (size_t)(slash - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.')
            ct_die(CT_EXIT_BAD_INPUT, "\"path\" may not contain \"..\"");
        if (n > 0 && !(n == 1 && p[0] == '.')) {
            if (len + 1 + n + 1 > MAX_PATH_BYTES) ct_die(CT_EXIT_BAD_INPUT, "\"path\" is too long");
            out[len++] = '/';
            memcpy(out + len, p, n);
            len += n;
            out[len] = '\0';
        }
        p += n + (slash ? 1 : 0);
    }
    return len;
}

int main(void) {
    ct_value args = ct_read_arguments("files.search");
    query = ct_string_arg(args, "query", 1, &query_len);
    if (query_len == 0) ct_die(CT_EXIT_BAD_INPUT, "the argument \"query\" is empty");
    if (query_len > MAX_QUERY_BYTES)
        ct_die(CT_EXIT_BAD_INPUT, "the argument \"query\" is longer than %d bytes",
               MAX_QUERY_BYTES);
    max_results = ct_int_arg(args, "max_results", DEFAULT_RESULTS, 1, MAX_RESULTS);
    size_t rel_len;
    const char *rel = ct_string_arg(args, "path", 0, &rel_len);
    if (rel == NULL) rel = ".";
    static char path[MAX_PATH_BYTES];
    size_t path_len = join_root(path, rel);
    struct stat st;
    if (stat(path, &st) != 0)
        ct_die(CT_EXIT_FAILED, "%s: %s (the tool sees only the paths its run grants)", path,
               strerror(errno));
    printf("{\"query\": ");
    ct_put_string(stdout, query, query_len);
    printf(", \"matches\": [");
    if (S_ISDIR(st.st_mode)) {
        walk(path, path_len, 0);
    } else if (S_ISREG(st.st_mode)) {
        files_seen = 1;
        search_file(path, st.st_size);
    }
    printf("], \"files\": %lld, \"skippedLarge\": %lld, \"truncated\": %s}",
           files_seen > MAX_FILES ? (long long)MAX_FILES : files_seen, skipped_large,
           truncated ? "true" : "false");
    ct_finish();
}
