//! Figures of Alibaba's openb trace, the request mix `Workload::openb` draws from:
//! `cluster-trace-gpu-v2023/csv/openb_pod_list_default.csv` of
//! <https://github.com/alibaba/clusterdata>, published with "Beware of Fragmentation:
//! Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent" (USENIX ATC '23).
//! Only these summaries are kept here, not the trace.

/// The percentiles 0, 1, …, 100 of how long a GPU pod of the trace ran, in seconds
/// (`deletion_time - scheduled_time` of its 6 203 scheduled GPU pods; nearest rank).
pub const HOLD_PERCENTILES: [u32; 101] = [
    4, 20, 29, 36, 43, 48, 51, 54, 59, 63, 67, 72, 77, 83, 91, 97, 110, 117, 127, 134, 143, 149,
    156, 164, 173, 183, 193, 199, 204, 211, 218, 226, 238, 249, 266, 279, 292, 313, 330, 349, 368,
    399, 425, 456, 488, 513, 539, 557, 579, 610, 655, 693, 739, 772, 808, 845, 890, 930, 947, 977,
    1037, 1086, 1135, 1181, 1221, 1282, 1347, 1414, 1495, 1567, 1694, 1805, 1945, 2046, 2150, 2303,
    2450, 2607, 2847, 3062, 3302, 3611, 3739, 3954, 4110, 4325, 4591, 4983, 5606, 6486, 7389, 8294,
    9896, 11519, 13570, 16994, 22833, 32330, 58148, 147608, 12537496,
];

/// The fractions of one GPU the trace's pods asked for (`gpu_milli` below 1000, one GPU),
/// each with how many of its 3 078 such pods asked for it.
pub const FRACTIONS: [(u32, u32); 20] = [
    (50, 7),
    (110, 24),
    (140, 1),
    (160, 74),
    (220, 62),
    (230, 140),
    (270, 4),
    (290, 1),
    (320, 328),
    (330, 7),
    (350, 6),
    (370, 47),
    (440, 2),
    (460, 128),
    (470, 750),
    (480, 19),
    (550, 72),
    (590, 75),
    (650, 253),
    (810, 1078),
];
