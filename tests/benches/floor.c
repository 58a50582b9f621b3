/* The floor of `gpuctl reserve --mem 1GiB -- COMMAND`: the same request on a new
 * connection (1 GiB, held by this process, a cgroup of its own), then execvp(COMMAND),
 * and nothing else: no argument parsing, no runtime, no JSON, no error handling worth the
 * name. benches/gpuctl_start.rs compiles it (cc -O2 -static) and times it beside gpuctl:
 * what gpuctl adds beyond it is gpuctl's own cost. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char **argv) {
    const char *path = getenv("GPUD_SOCKET");
    if (argc < 2 || path == NULL)
        return 2;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
        return 3;
    char body[128], request[512];
    int n = snprintf(body, sizeof body,
                     "{\"memory\":1073741824,\"holder_pid\":%d,\"own_cgroup\":true}",
                     (int)getpid());
    int m = snprintf(request, sizeof request,
                     "POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\n"
                     "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
                     n, body);
    if (write(fd, request, (size_t)m) != m)
        return 4;
    char reply[16384];
    ssize_t got = 0, r;
    while ((r = read(fd, reply + got, sizeof reply - 1 - (size_t)got)) > 0)
        got += r;
    reply[got] = 0;
    if (strncmp(reply, "HTTP/1.1 201", 12) != 0)
        return 5;
    close(fd);
    execvp(argv[1], argv + 1);
    return 6;
}
