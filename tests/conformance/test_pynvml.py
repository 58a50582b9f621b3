"""Conformance of the fake NVML library with the official Python binding (nvidia-ml-py).

For every fixture in tests/fixtures, pynvml must read back exactly what the fixture says.
The expected values are computed here from the JSON, independently of the Rust parser.

Run: cargo build -p fake-nvml && python3 -m pytest tests/conformance -q
The library is target/debug/libfake_nvml.so under the repository root, or $FAKE_NVML_LIB.

pynvml loads the library once per process and caches function pointers, so this process
uses one library and switches fixtures through FAKE_NVML_CONFIG, which the library reads
at every first nvmlInit (each test shuts down again). Tests of the stock loading path
(dlopen "libnvidia-ml.so.1" via LD_LIBRARY_PATH) run in subprocesses.
"""

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES_DIR = REPO / "tests" / "fixtures"
FIXTURES = sorted(FIXTURES_DIR.glob("*.json"))
LIB_PATH = Path(os.environ.get("FAKE_NVML_LIB", REPO / "target" / "debug" / "libfake_nvml.so"))

PCIE_LEVELS = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50, "SOC": 50}
NO_INSTANCE = 0xFFFFFFFF
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2


class ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t (16 bytes), which pynvml no longer defines."""
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


# ---------------------------------------------------------------------------------------
# Independent reading of the fixture format (tests/fake-nvml/README.md).
# ---------------------------------------------------------------------------------------

def parse_cpus(value):
    if value is None:
        return None
    if isinstance(value, list):
        return sorted(value)
    cpus = []
    for part in value.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return sorted(cpus)


def as_text(value):
    """pynvml hands back char arrays as str or bytes depending on the field."""
    return value.decode() if isinstance(value, bytes) else value


def norm_bus_id(text):
    """8-digit domain, upper case: how NVML's busId field spells it."""
    parts = as_text(text).strip().upper().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    domain, bus, devfn = parts
    return f"{int(domain, 16):08X}:{bus}:{devfn}"


def hex_value(value):
    return int(value, 16) if isinstance(value, str) and value.lower().startswith("0x") else int(value)


def expected_memory(gpu, instance=None):
    """(total, reserved, free, used) as the v2 query must report them."""
    procs = gpu.get("processes", [])
    if instance is None:
        mig_extra = sum(i.get("memory_used_bytes", 0) for i in gpu.get("mig", {}).get("instances", []))
        total = gpu["memory_total_bytes"]
        reserved = gpu.get("memory_reserved_bytes", 0)
        used = gpu.get("memory_used_bytes", 0) + mig_extra + sum(
            p.get("used_memory_bytes") or 0 for p in procs)
    else:
        inst = gpu["mig"]["instances"][instance]
        total, reserved = inst["memory_total_bytes"], 0
        used = inst.get("memory_used_bytes", 0) + sum(
            p.get("used_memory_bytes") or 0 for p in procs if p.get("mig_instance") == instance)
    return total, reserved, total - reserved - used, used


def expected_pcie(fixture):
    gpus = fixture["gpus"]
    matrix = fixture.get("topology", {}).get("pcie")
    n = len(gpus)
    if matrix is None:
        return [[0 if a == b else 40 if gpus[a].get("numa_node") == gpus[b].get("numa_node") else 50
                 for b in range(n)] for a in range(n)]
    return [[PCIE_LEVELS[c.upper()] for c in row] for row in matrix]


def expected_nvlink_pairs(fixture):
    """Pair link counts the fixture describes: the direct matrix, or for NVSwitch systems
    every pair of NVLink GPUs gets the links they share through common switches."""
    gpus = fixture["gpus"]
    n = len(gpus)
    topo = fixture.get("topology", {})
    if "nvlink" in topo:
        return topo["nvlink"]
    if "nvswitch" in topo:
        sw = topo["nvswitch"]
        per, count = sw["links_per_switch"], len(sw["bus_ids"])

        def per_switch(g):
            links = gpus[g].get("nvlink_links", 0)
            return [max(0, min(per, links - s * per)) for s in range(count)]

        return [[0 if a == b else sum(min(x, y) for x, y in zip(per_switch(a), per_switch(b)))
                 for b in range(n)] for a in range(n)]
    return [[0] * n for _ in range(n)]


# ---------------------------------------------------------------------------------------
# The client algorithm gpud's discovery uses (README: "Computing NVLink pair counts").
# ---------------------------------------------------------------------------------------

def nvlink_pairs_via_nvml(handles):
    bus_ids = [norm_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    index_of = {b: i for i, b in enumerate(bus_ids)}
    n = len(handles)
    direct = [[0] * n for _ in range(n)]
    to_switch = [dict() for _ in range(n)]
    for a, h in enumerate(handles):
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = pynvml.nvmlDeviceGetNvLinkState(h, link)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                break  # no NVLink at all, or past this GPU's last link
            if not active:
                continue
            remote = norm_bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            if remote in index_of:
                direct[a][index_of[remote]] += 1
            else:
                to_switch[a][remote] = to_switch[a].get(remote, 0) + 1
    return [[0 if a == b else direct[a][b] + sum(
        min(c, to_switch[b][s]) for s, c in to_switch[a].items() if s in to_switch[b])
        for b in range(n)] for a in range(n)]


# ---------------------------------------------------------------------------------------
# Harness.
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def lib():
    if not LIB_PATH.is_file():
        pytest.fail(f"{LIB_PATH} is missing: run `cargo build -p fake-nvml` first "
                    f"(or point FAKE_NVML_LIB at the library)", pytrace=False)
    if pynvml.nvmlLib is None:
        pynvml.nvmlLib = ctypes.CDLL(str(LIB_PATH))
    return pynvml.nvmlLib


class Machine:
    """One fixture loaded into the library; `write` swaps in a new version by rename."""

    def __init__(self, lib, path, data):
        self.lib, self.path, self.data = lib, path, data

    def write(self, data):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
        self.data = data

    def handles(self):
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(len(self.data["gpus"]))]


@pytest.fixture
def machine_factory(lib, tmp_path, monkeypatch):
    started = []

    def start(data):
        path = tmp_path / "machine.json"
        path.write_text(json.dumps(data))
        monkeypatch.setenv("FAKE_NVML_CONFIG", str(path))
        pynvml.nvmlInit()
        started.append(True)
        return Machine(lib, path, data)

    yield start
    for _ in started:
        pynvml.nvmlShutdown()


def load(path):
    return json.loads(Path(path).read_text())


def addr(handle):
    return ctypes.cast(handle, ctypes.c_void_p).value


def fixture_ids():
    return [p.stem for p in FIXTURES]


def test_all_reference_machines_present():
    names = {p.stem for p in FIXTURES}
    assert {"dgx1-v100", "dgx-a100", "pcie-8gpu-2socket", "t4-pair", "mixed-a100", "a100-mig"} <= names


# ---------------------------------------------------------------------------------------
# Per fixture: everything pynvml reads matches the JSON.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture_path", FIXTURES, ids=fixture_ids())
def test_fixture_reads_back_exactly(machine_factory, fixture_path):
    data = load(fixture_path)
    m = machine_factory(data)
    gpus = data["gpus"]

    assert pynvml.nvmlSystemGetDriverVersion() == data["driver_version"]
    assert pynvml.nvmlSystemGetNVMLVersion() == data.get("nvml_version", "12." + data["driver_version"])
    assert pynvml.nvmlSystemGetCudaDriverVersion() == data["cuda_driver_version"]
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == data["cuda_driver_version"]
    assert pynvml.nvmlDeviceGetCount() == len(gpus)

    handles = m.handles()
    assert len({addr(h) for h in handles}) == len(handles) and all(addr(h) for h in handles)
    for i, (h, g) in enumerate(zip(handles, gpus)):
        assert pynvml.nvmlDeviceGetIndex(h) == i
        assert pynvml.nvmlDeviceGetName(h) == g["name"]
        assert pynvml.nvmlDeviceGetUUID(h) == g["uuid"]
        assert pynvml.nvmlDeviceGetMinorNumber(h) == g.get("minor_number", i)
        assert addr(pynvml.nvmlDeviceGetHandleByUUID(g["uuid"])) == addr(h)

        pci = pynvml.nvmlDeviceGetPciInfo(h)
        bus_id = norm_bus_id(g["pci_bus_id"])
        assert as_text(pci.busId) == bus_id
        assert as_text(pci.busIdLegacy) == bus_id[4:]
        assert (pci.domain, pci.bus, pci.device) == (
            int(bus_id[:8], 16), int(bus_id[9:11], 16), int(bus_id[12:14], 16))
        assert pci.pciDeviceId == hex_value(g["pci_device_id"]) << 16 | 0x10DE
        assert pci.pciSubSystemId == hex_value(g.get("pci_subsystem_id", 0))
        for form in (bus_id, bus_id[4:], bus_id.lower(), bus_id[4:].lower()):
            assert addr(pynvml.nvmlDeviceGetHandleByPciBusId(form)) == addr(h)

        total, reserved, free, used = expected_memory(g)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        assert (v1.total, v1.free, v1.used) == (total, free, used + reserved)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        assert (v2.total, v2.reserved, v2.free, v2.used) == (total, reserved, free, used)
        assert v2.total == v2.reserved + v2.free + v2.used

        if "numa_node" in g:
            assert pynvml.nvmlDeviceGetNumaNodeId(h) == g["numa_node"]
        if "architecture" in g:
            code = getattr(pynvml, "NVML_DEVICE_ARCH_" + g["architecture"].upper())
            assert pynvml.nvmlDeviceGetArchitecture(h) == code
        else:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetArchitecture(h)
        if "cuda_compute_capability" in g:
            major, minor = map(int, g["cuda_compute_capability"].split("."))
            assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (major, minor)
        else:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetCudaComputeCapability(h)
        cpus = parse_cpus(g.get("cpus"))
        if cpus is not None:
            words = max(cpus) // 64 + 2
            mask = pynvml.nvmlDeviceGetCpuAffinity(h, words)
            got = [w * 64 + b for w in range(words) for b in range(64) if mask[w] >> b & 1]
            assert got == cpus

        assert pynvml.nvmlDeviceGetPersistenceMode(h) == int(g.get("persistence_mode", True))
        assert pynvml.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_DEFAULT
        assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == g.get("temperature_c", 40)
        assert pynvml.nvmlDeviceGetComputeRunningProcesses(h) == []
        assert pynvml.nvmlDeviceGetGraphicsRunningProcesses(h) == []
        assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h) == []

        if "mig" in g:
            enabled = g["mig"]["enabled"]
            assert pynvml.nvmlDeviceGetMigMode(h) == [int(enabled), int(g["mig"].get("pending_enabled", enabled))]
        else:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetMigMode(h)
        assert pynvml.nvmlDeviceIsMigDeviceHandle(h).value == 0
        assert pynvml.nvmlDeviceGetSupportedEventTypes(h) == pynvml.nvmlEventTypeXidCriticalError

    pcie = expected_pcie(data)
    for a, ha in enumerate(handles):
        for b, hb in enumerate(handles):
            assert pynvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb) == pcie[a][b], (a, b)

    assert nvlink_pairs_via_nvml(handles) == expected_nvlink_pairs(data)


@pytest.mark.parametrize("fixture_path", FIXTURES, ids=fixture_ids())
def test_nvlink_links_per_gpu(machine_factory, fixture_path):
    data = load(fixture_path)
    m = machine_factory(data)
    switch_bus_ids = {norm_bus_id(b) for b in data.get("topology", {}).get("nvswitch", {}).get("bus_ids", [])}
    for h, g in zip(m.handles(), data["gpus"]):
        links = g.get("nvlink_links", 0)
        if links == 0:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetNvLinkState(h, 0)
            continue
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetNvLinkState(h, links)
        for link in range(links):
            if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_DISABLED:
                with pytest.raises(pynvml.NVMLError_NotSupported):
                    pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
                continue
            remote = norm_bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
            assert (remote in switch_bus_ids) == (kind == NVML_NVLINK_DEVICE_TYPE_SWITCH)


# ---------------------------------------------------------------------------------------
# Processes, MIG, errors, reload.
# ---------------------------------------------------------------------------------------

def test_processes_with_real_pids(machine_factory):
    data = load(FIXTURES_DIR / "t4-pair.json")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        data["gpus"][0]["processes"] = [
            {"pid": os.getpid(), "used_memory_bytes": 2 << 30},
            {"pid": child.pid, "used_memory_bytes": 8 << 30, "type": "compute"},
            {"pid": child.pid, "used_memory_bytes": None, "type": "graphics"},
        ]
        data["gpus"][1]["memory_reserved_bytes"] = 256 << 20
        m = machine_factory(data)
        h0, h1 = m.handles()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h0)
        assert [(p.pid, p.usedGpuMemory) for p in procs] == [(os.getpid(), 2 << 30), (child.pid, 8 << 30)]
        assert all(p.gpuInstanceId == NO_INSTANCE and p.computeInstanceId == NO_INSTANCE for p in procs)
        graphics = pynvml.nvmlDeviceGetGraphicsRunningProcesses(h0)
        assert [(p.pid, p.usedGpuMemory) for p in graphics] == [(child.pid, None)]
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h0, version=pynvml.nvmlMemory_v2)
        assert (v2.used, v2.free) == (10 << 30, (15 << 30) - (10 << 30))
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h1, version=pynvml.nvmlMemory_v2)
        assert (v2.reserved, v2.used, v2.free) == (256 << 20, 0, (15 << 30) - (256 << 20))
        v1 = pynvml.nvmlDeviceGetMemoryInfo(h1)
        assert (v1.used, v1.free) == (256 << 20, (15 << 30) - (256 << 20))

        # v1 (16-byte) and v2 entry layouts through direct calls.
        lib = m.lib
        count = ctypes.c_uint(0)
        assert lib.nvmlDeviceGetComputeRunningProcesses(h0, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert count.value == 2
        v1_entries = (ProcessInfoV1 * 2)()
        assert lib.nvmlDeviceGetComputeRunningProcesses(h0, ctypes.byref(count), v1_entries) == 0
        assert [(e.pid, e.usedGpuMemory) for e in v1_entries] == [(os.getpid(), 2 << 30), (child.pid, 8 << 30)]
        count = ctypes.c_uint(1)
        v2_entries = (pynvml.c_nvmlProcessInfo_v2_t * 1)()
        assert lib.nvmlDeviceGetComputeRunningProcesses_v2(h0, ctypes.byref(count), v2_entries) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert count.value == 2
    finally:
        child.kill()
        child.wait()


def test_mps_clients_with_real_pids(machine_factory):
    """An MPS client (`"mps": true`) is in the MPS list and the compute list (nvidia-smi's
    `M+C`); its server is an ordinary compute process (`C`)."""
    data = load(FIXTURES_DIR / "t4-pair.json")
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        data["gpus"][0]["processes"] = [
            {"pid": server.pid, "used_memory_bytes": 66 << 20},
            {"pid": os.getpid(), "used_memory_bytes": 1 << 30, "mps": True},
        ]
        m = machine_factory(data)
        h0, h1 = m.handles()
        mps = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h0)
        assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in mps] == [
            (os.getpid(), 1 << 30, NO_INSTANCE, NO_INSTANCE)]
        assert [p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v2(h0)] == [os.getpid()]
        compute = pynvml.nvmlDeviceGetComputeRunningProcesses(h0)
        assert [p.pid for p in compute] == [server.pid, os.getpid()]
        assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h1) == []

        # The unversioned call fills 16-byte v1 entries.
        count = ctypes.c_uint(0)
        assert m.lib.nvmlDeviceGetMPSComputeRunningProcesses(h0, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert count.value == 1
        v1_entries = (ProcessInfoV1 * 1)()
        assert m.lib.nvmlDeviceGetMPSComputeRunningProcesses(h0, ctypes.byref(count), v1_entries) == 0
        assert [(e.pid, e.usedGpuMemory) for e in v1_entries] == [(os.getpid(), 1 << 30)]
    finally:
        server.kill()
        server.wait()


def test_mig_instances(machine_factory):
    data = load(FIXTURES_DIR / "a100-mig.json")
    gpu0 = data["gpus"][0]
    instances = gpu0["mig"]["instances"]
    gpu0["processes"] = [
        {"pid": os.getpid(), "used_memory_bytes": 1 << 30, "mig_instance": 0},
        {"pid": os.getppid(), "used_memory_bytes": 3 << 30, "mig_instance": 2, "mps": True},
    ]
    m = machine_factory(data)
    h0, h1 = m.handles()

    assert pynvml.nvmlDeviceGetMigMode(h0) == [1, 1]
    assert pynvml.nvmlDeviceGetMigMode(h1) == [0, 0]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h1) == 0
    max_count = pynvml.nvmlDeviceGetMaxMigDeviceCount(h0)
    assert max_count == gpu0["mig"]["max_devices"]

    found = []
    for i in range(max_count):
        try:
            found.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, i))
        except pynvml.NVMLError_NotFound:
            pass
    assert len(found) == len(instances)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, max_count)

    for i, (mh, inst) in enumerate(zip(found, instances)):
        assert pynvml.nvmlDeviceIsMigDeviceHandle(mh).value == 1
        assert pynvml.nvmlDeviceGetUUID(mh) == inst["uuid"]
        assert inst["uuid"].startswith("MIG-")
        assert pynvml.nvmlDeviceGetName(mh) == inst["name"]
        assert pynvml.nvmlDeviceGetGpuInstanceId(mh) == inst["gpu_instance_id"]
        assert pynvml.nvmlDeviceGetComputeInstanceId(mh) == inst["compute_instance_id"]
        assert addr(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mh)) == addr(h0)
        assert addr(pynvml.nvmlDeviceGetHandleByUUID(inst["uuid"])) == addr(mh)
        total, reserved, free, used = expected_memory(gpu0, i)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(mh, version=pynvml.nvmlMemory_v2)
        assert (v2.total, v2.reserved, v2.free, v2.used) == (total, reserved, free, used)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(mh)
        assert (v1.total, v1.free, v1.used) == (total, free, used)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(mh)
        expected = [(p["pid"], p["used_memory_bytes"], inst["gpu_instance_id"], inst["compute_instance_id"])
                    for p in gpu0["processes"] if p["mig_instance"] == i]
        assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in procs] == expected
        mps = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(mh)
        assert [p.pid for p in mps] == [p["pid"] for p in gpu0["processes"]
                                        if p["mig_instance"] == i and p.get("mps")]

    # The MIG-mode parent lists every instance's processes with their instance ids.
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h0)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in procs] == [
        (os.getpid(), instances[0]["gpu_instance_id"], instances[0]["compute_instance_id"]),
        (os.getppid(), instances[2]["gpu_instance_id"], instances[2]["compute_instance_id"]),
    ]
    procs = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h0)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in procs] == [
        (os.getppid(), instances[2]["gpu_instance_id"], instances[2]["compute_instance_id"]),
    ]
    parent = pynvml.nvmlDeviceGetMemoryInfo(h0, version=pynvml.nvmlMemory_v2)
    assert parent.used == 4 << 30
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(h0)
    assert pynvml.nvmlDeviceGetUtilizationRates(h1).gpu == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetPciInfo(found[0])


def test_error_injection_and_reload_on_rename(machine_factory):
    data = load(FIXTURES_DIR / "dgx1-v100.json")
    m = machine_factory(data)
    handles = m.handles()
    assert pynvml.nvmlDeviceGetName(handles[3]) == "Tesla V100-SXM2-32GB"

    data["errors"] = [
        {"device": 3, "call": "*", "code": "GPU_IS_LOST"},
        {"device": data["gpus"][1]["uuid"], "call": "nvmlDeviceGetMemoryInfo_v2", "code": 999},
        {"call": "nvmlSystemGetDriverVersion", "code": "NVML_ERROR_NOT_SUPPORTED"},
    ]
    data["gpus"][0]["processes"] = [{"pid": os.getpid(), "used_memory_bytes": 5 << 30}]
    m.write(data)

    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetName(handles[3])
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[0], handles[3])
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetMemoryInfo(handles[1], version=pynvml.nvmlMemory_v2)
    pynvml.nvmlDeviceGetMemoryInfo(handles[1])  # only the v2 call was failed
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlSystemGetDriverVersion()
    assert pynvml.nvmlDeviceGetCount() == 8
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handles[0])] == [os.getpid()]

    # An invalid rewrite keeps the last good fixture.
    m.path.with_suffix(".tmp").write_text("{ broken")
    os.replace(m.path.with_suffix(".tmp"), m.path)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetName(handles[3])

    data["errors"] = []
    data["gpus"][3]["name"] = "Tesla V100-SXM2-16GB"
    m.write(data)
    assert pynvml.nvmlDeviceGetName(handles[3]) == "Tesla V100-SXM2-16GB"
    assert pynvml.nvmlSystemGetDriverVersion() == data["driver_version"]


def test_xid_events(machine_factory):
    data = load(FIXTURES_DIR / "a100-mig.json")
    m = machine_factory(data)
    h0, h1 = m.handles()
    assert pynvml.nvmlDeviceGetSupportedEventTypes(h1) == pynvml.nvmlEventTypeXidCriticalError
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetSupportedEventTypes(mig)

    event_set = pynvml.nvmlEventSetCreate()
    try:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceRegisterEvents(h1, pynvml.nvmlEventTypePState, event_set)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceRegisterEvents(mig, pynvml.nvmlEventTypeXidCriticalError, event_set)
        data["gpus"][1]["xid_errors"] = [13]
        m.write(data)
        pynvml.nvmlDeviceRegisterEvents(h1, pynvml.nvmlEventTypeXidCriticalError, event_set)
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(event_set, 0)  # Xid 13 came before registration

        data["gpus"][1]["xid_errors"] = [13, 79]
        m.write(data)
        event = pynvml.nvmlEventSetWait_v2(event_set, 2000)
        assert event.eventType == pynvml.nvmlEventTypeXidCriticalError
        assert event.eventData == 79
        assert (event.gpuInstanceId, event.computeInstanceId) == (NO_INSTANCE, NO_INSTANCE)
        assert pynvml.nvmlDeviceGetUUID(event.device) == data["gpus"][1]["uuid"]
        assert addr(event.device) == addr(h1)
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(event_set, 50)  # each Xid once

        data["errors"] = [{"device": 1, "call": "nvmlEventSetWait_v2", "code": "GPU_IS_LOST"}]
        m.write(data)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlEventSetWait_v2(event_set, 0)
    finally:
        pynvml.nvmlEventSetFree(event_set)
    assert m.lib.nvmlEventSetFree(event_set) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_bad_arguments_do_not_crash(machine_factory):
    m = machine_factory(load(FIXTURES_DIR / "t4-pair.json"))
    lib = m.lib
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    small = ctypes.create_string_buffer(4)
    assert lib.nvmlDeviceGetUUID(h, small, 4) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert lib.nvmlDeviceGetName(h, small, 0) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert lib.nvmlSystemGetDriverVersion(small, 4) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    exact = ctypes.create_string_buffer(len(m.data["gpus"][0]["uuid"]) + 1)
    assert lib.nvmlDeviceGetUUID(h, exact, len(exact)) == 0
    assert lib.nvmlDeviceGetUUID(h, exact, len(exact) - 1) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert lib.nvmlDeviceGetCount_v2(None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetUUID(h, None, 96) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetMemoryInfo(h, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetHandleByUUID(None, ctypes.byref(pynvml.c_nvmlDevice_t())) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetComputeRunningProcesses_v3(h, None, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    for bogus in (0, 0x999, 0x1000, 0x1001, 0xFFFFFFFF):
        idx = ctypes.c_uint()
        assert lib.nvmlDeviceGetIndex(ctypes.c_void_p(bogus), ctypes.byref(idx)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByPciBusId("0000:01:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByPciBusId("not-a-bus-id")
    mem = pynvml.c_nvmlMemory_v2_t()
    mem.version = 0x01000028
    assert lib.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(mem)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetTemperature(h, 1)
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
    assert pynvml.nvmlErrorString(123456) == "Unknown Error"


# ---------------------------------------------------------------------------------------
# The stock loading path, in fresh processes.
# ---------------------------------------------------------------------------------------

def run_stock_pynvml(lib, tmp_path, config, script):
    libdir = tmp_path / "lib"
    libdir.mkdir(exist_ok=True)
    link = libdir / "libnvidia-ml.so.1"
    if not link.exists():
        link.symlink_to(LIB_PATH)
    env = dict(os.environ, LD_LIBRARY_PATH=str(libdir), FAKE_NVML_CONFIG=str(config))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_stock_pynvml_finds_it_by_soname(lib, tmp_path):
    out = run_stock_pynvml(lib, tmp_path, FIXTURES_DIR / "dgx-a100.json", """
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(7)
        print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetName(h))
        pynvml.nvmlShutdown()
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8 NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize("config,error,reason", [
    ("missing.json", "NVMLError_Unknown", "cannot read fixture"),
    ("invalid.json", "NVMLError_Unknown", "invalid fixture"),
    ("init-error.json", "NVMLError_DriverNotLoaded", ""),
])
def test_init_failures_are_codes_with_a_reason(lib, tmp_path, config, error, reason):
    (tmp_path / "invalid.json").write_text('{"gpus": [{"name": "x"}]}')
    data = load(FIXTURES_DIR / "t4-pair.json")
    data["init_error"] = "DRIVER_NOT_LOADED"
    (tmp_path / "init-error.json").write_text(json.dumps(data))
    out = run_stock_pynvml(lib, tmp_path, tmp_path / config, """
        import pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            print(type(e).__name__)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == error
    assert reason in out.stderr


# ---------------------------------------------------------------------------------------
# Per-cgroup memory limits (driver R615: nvmlDevice{Set,Get}MemoryLimits_v1).
# ---------------------------------------------------------------------------------------

GIB = 1 << 30


def cgroup2_mount():
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        if after.split()[0] == "cgroup2":
            return Path(before.split()[4])
    return None


def limits(device, cgroup):
    value = pynvml.c_nvmlGetMemoryLimits_v1_t()
    value.nameSpace = str(cgroup).encode()
    pynvml.nvmlDeviceGetMemoryLimits_v1(device, value)
    return value.softLimit, value.hardLimit, value.currentUsed


def set_limits(device, cgroup, soft, hard):
    value = pynvml.c_nvmlSetMemoryLimits_v1_t()
    value.nameSpace = None if cgroup is None else str(cgroup).encode()
    value.softLimit, value.hardLimit = soft, hard
    pynvml.nvmlDeviceSetMemoryLimits_v1(device, value)


def nvml_error(call):
    with pytest.raises(pynvml.NVMLError) as e:
        call()
    return e.value.value


# A separate process using the library: what it sees of GPU 0 (memory total, and the
# limits of the cgroup named), after moving itself into `join` if given; then, as `uid`
# (if not 0), whether it may set a limit.
OTHER_PROCESS = textwrap.dedent("""
    import ctypes, json, os, sys
    import pynvml
    join, cgroup, uid = sys.argv[2], sys.argv[3], int(sys.argv[4])
    if join:
        open(os.path.join(join, "cgroup.procs"), "w").write(str(os.getpid()))
    pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    out = {"total": pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).total}
    v = pynvml.c_nvmlGetMemoryLimits_v1_t()
    v.nameSpace = cgroup.encode()
    try:
        pynvml.nvmlDeviceGetMemoryLimits_v1(h, v)
        out["limits"] = [v.softLimit, v.hardLimit, v.currentUsed]
    except pynvml.NVMLError as e:
        out["limits"] = e.value
    if uid:
        os.setuid(uid)
    s = pynvml.c_nvmlSetMemoryLimits_v1_t()
    s.nameSpace, s.softLimit, s.hardLimit = cgroup.encode(), 1, 2
    try:
        pynvml.nvmlDeviceSetMemoryLimits_v1(h, s) if uid else None
        out["set"] = 0
    except pynvml.NVMLError as e:
        out["set"] = e.value
    print(json.dumps(out))
""")


def other_process(cgroup, join="", uid=0):
    out = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, str(LIB_PATH), join, str(cgroup), str(uid)],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_memory_limits_per_cgroup(machine_factory, tmp_path):
    mount = cgroup2_mount()
    if os.geteuid() != 0 or mount is None:
        if os.environ.get("CI"):
            pytest.fail("CI runs this as root with cgroup v2 mounted", pytrace=False)
        pytest.skip("needs root and a cgroup v2 mount")
    data = load(FIXTURES_DIR / "t4-pair.json")
    data["driver_version"] = "615.12.01"
    cgroup = mount / f"fake-nvml-conformance-{os.getpid()}"
    cgroup.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (cgroup / "cgroup.procs").write_text(str(sleeper.pid))
        data["gpus"][0]["processes"] = [
            {"pid": sleeper.pid, "used_memory_bytes": 1 * GIB},
            {"pid": os.getpid(), "used_memory_bytes": 2 * GIB},
        ]
        m = machine_factory(data)
        h0, h1 = m.handles()
        assert nvml_error(lambda: limits(h0, cgroup)) == pynvml.NVML_ERROR_NOT_FOUND

        set_limits(h0, cgroup, 4 * GIB, 4 * GIB)
        # Only the processes in the cgroup count; only GPU 0 is limited.
        assert limits(h0, cgroup) == (4 * GIB, 4 * GIB, 1 * GIB)
        assert nvml_error(lambda: limits(h1, cgroup)) == pynvml.NVML_ERROR_NOT_FOUND
        # Every process sees the driver's map; inside the cgroup the card is 4 GiB.
        outside = other_process(cgroup)
        assert outside == {"total": 15 * GIB, "limits": [4 * GIB, 4 * GIB, 1 * GIB], "set": 0}
        inside = other_process(cgroup, join=str(cgroup))
        assert inside["total"] == 4 * GIB
        # Setting needs root.
        nobody = other_process(cgroup, uid=65534)
        assert nobody["limits"] == [4 * GIB, 4 * GIB, 1 * GIB]
        assert nobody["set"] == pynvml.NVML_ERROR_NO_PERMISSION

        # As nvml.h documents the errors.
        bad = [
            lambda: set_limits(h0, None, 1, 2),
            lambda: set_limits(h0, cgroup, 2 * GIB, 1 * GIB),
            lambda: set_limits(h0, cgroup, 1, 16 * GIB),
        ]
        assert [nvml_error(call) for call in bad] == [pynvml.NVML_ERROR_INVALID_ARGUMENT] * 3
        missing = cgroup / "no-such-child"
        assert nvml_error(lambda: set_limits(h0, missing, 1, 2)) == pynvml.NVML_ERROR_OPERATING_SYSTEM
        assert nvml_error(lambda: limits(h0, missing)) == pynvml.NVML_ERROR_OPERATING_SYSTEM

        # Reset: soft 0, hard max. The cgroup has no limit left, and sees the whole card.
        set_limits(h0, cgroup, 0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX)
        assert nvml_error(lambda: limits(h0, cgroup)) == pynvml.NVML_ERROR_NOT_FOUND
        assert other_process(cgroup, join=str(cgroup))["total"] == 15 * GIB

        # An older driver has neither call.
        data["driver_version"] = "550.54.15"
        m.write(data)
        assert nvml_error(lambda: limits(h0, cgroup)) == pynvml.NVML_ERROR_NOT_SUPPORTED
        assert nvml_error(lambda: set_limits(h0, cgroup, 1, 2)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    finally:
        sleeper.kill()
        sleeper.wait()
        for _ in range(100):
            try:
                cgroup.rmdir()
                break
            except OSError:
                import time
                time.sleep(0.05)


def test_memory_limits_reject_mig_devices(machine_factory):
    data = load(FIXTURES_DIR / "a100-mig.json")
    data["driver_version"] = "615.12.01"
    m = machine_factory(data)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(m.handles()[0], 0)
    assert nvml_error(lambda: limits(mig, "/sys/fs/cgroup/x")) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml_error(lambda: set_limits(mig, "/sys/fs/cgroup/x", 1, 2)) == pynvml.NVML_ERROR_NOT_SUPPORTED
