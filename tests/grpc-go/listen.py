import socket, sys, os, time, threading
path, out = sys.argv[1], sys.argv[2]
os.makedirs(os.path.dirname(path), exist_ok=True)
try: os.unlink(path)
except FileNotFoundError: pass
s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(1)

c, _ = s.accept()
c.sendall(bytes([0,0,0, 4, 0, 0,0,0,0]))  # empty SETTINGS
data = b""; acked = False
c.settimeout(0.2); idle = 0
while idle < 10:
    try:
        b = c.recv(65536)
        if not b: break
        data += b; idle = 0
        if not acked and len(data) > 24 + 9:
            c.sendall(bytes([0,0,0, 4, 1, 0,0,0,0])); acked = True
    except socket.timeout:
        idle += 1
open(out, "wb").write(data)
os.unlink(path)
