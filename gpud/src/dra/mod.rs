//! Kubernetes DRA: gpud as a Dynamic Resource Allocation driver (`gpu.gpud.io`), so that a
//! ResourceClaim for "4Gi on one GPU" becomes an exact, enforced gpud reservation of those
//! bytes on the GPU the scheduler allocated.
//!
//! Depends on `broker` (exact reservations, releases), `cdi` (device names), `model` and
//! the kubelet protos (`kubelet::proto`).
//!
//! # Pieces
//!
//! - [`claims`] (pure): a unit's DRA device name, the reservation id of a claim, and the
//!   exact request that a claim's allocation asks of the ledger.
//! - [`plugin`]: the kubelet's `DRAPlugin` gRPC service (`NodePrepareResources`,
//!   `NodeUnprepareResources`) over the broker, reading each claim's allocation from a
//!   [`Claims`] source (the API server).
//! - [`kube`]: ResourceClaims read from the API server (kube-rs); [`quantity`]: Kubernetes
//!   quantities as bytes.
//! - [`slices`]: the node's ResourceSlice: a device per GPU and per MIG instance, with the
//!   attributes a claim selects on and each GPU's memory as consumable capacity.
//! - [`driver`]: the driver in `gpud run`: the sockets, the slice kept in step with the
//!   machine, and the release of reservations whose claim is gone.
//! - [`view`] (pure): the cluster-wide view `kubectl gpud` prints.
//! - [`health`]: the kubelet's `DRAResourceHealth` stream, each device's health, served on
//!   the DRA endpoint beside [`plugin`].
//! - [`registration`]: the plugin registration socket the kubelet's plugin watcher finds,
//!   and the DRA endpoint it then calls.
//!
//! # Decisions
//!
//! - **One reservation per claim**, id `dra-<claim uid>`, made with the kubelet's exact
//!   requests (no placement: the scheduler chose the devices; the capacity check still
//!   refuses anything gpud already promised elsewhere, as a clear claim error). One
//!   reservation, so that one environment (`CUDA_VISIBLE_DEVICES` naming every GPU of the
//!   claim) reaches the container through one CDI device.
//! - **What is enforced** is the allocation's `consumedCapacity` `memory` on each shared
//!   device; a device allocated without it is reserved whole (exclusive). A claim that mixes
//!   both is refused: make two claims.
//! - **Idempotent**: a Prepare for a claim whose reservation is active answers the same
//!   devices again; an Unprepare of a claim with none active succeeds. The reservation
//!   table is the driver's checkpoint: a restart loses nothing.
//! - **A consumed amount is checked, never guessed**: one that is not a quantity of bytes,
//!   is zero or negative, or is more than the device has makes the claim's error; gpud
//!   never fails towards reserving more than the allocation says.
//! - **Prepared again after an unprepare**: the resourceclaim controller deallocates an
//!   unused claim and may allocate it again under the same UID (a second pod). Its new
//!   reservation takes `dra-<uid>` again; the ended one stays in the history as
//!   `dra-<uid>.<n>`.
//! - **CDI is required**: the claim's container gets its environment and its memory limit
//!   through the reservation's CDI device (`gpud.io/reservation=dra-<uid>`), named on every
//!   device of the claim, so that a container naming any one request gets it. A container
//!   naming the whole claim gets it once per device: runtimes apply a CDI device's edits
//!   by name and path, and its hook's second attach of the same cgroup changes nothing.
//! - **Request names as the kubelet matches them**: a device allocated for a
//!   `firstAvailable` subrequest (`gpu/small`) is answered for its request (`gpu`), the name
//!   a container references.
//! - **Every API call is bounded** (`[dra] api_timeout`), and kube-rs's own retries are off:
//!   the kubelet retries a Prepare that failed, and the resync loop its next pass. A slow
//!   or failing API server never holds a Prepare past the kubelet's 45 s deadline, nor the
//!   resync loop past one timeout per call.

pub mod claims;
pub mod driver;
pub mod health;
pub mod kube;
pub mod plugin;
pub mod quantity;
pub mod registration;
pub mod slices;
pub mod view;

/// The driver's name: the DeviceClass selects it, the ResourceSlices carry it.
pub const DRIVER: &str = "gpu.gpud.io";

/// The DRA plugin API versions gpud serves, as `GetInfo` lists them.
pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// The claim a kubelet call names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID (a claim deleted and made again has a new one).
    pub uid: String,
}

/// One device of this driver allocated to a claim, as the claim's status says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// The claim's request it serves.
    pub request: String,
    /// The driver that allocated it (devices of other drivers are theirs to prepare).
    pub driver: String,
    /// Its pool (this node's).
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The share of a device several claims use (consumable capacity).
    pub share_id: Option<String>,
    /// `consumedCapacity["memory"]` as the API server wrote it: what the claim may use
    /// there, checked by [`claims::exact_request`] against the device. `None`: the whole
    /// device.
    pub consumed_memory: Option<String>,
}

/// A claim and what the scheduler allocated to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimAllocation {
    /// The claim.
    pub claim: ClaimRef,
    /// Its allocated devices, of every driver; empty: not allocated.
    pub devices: Vec<AllocatedDevice>,
}

/// Where claims are read from: the API server (or a stand-in in tests).
#[tonic::async_trait]
pub trait Claims: Send + Sync + std::fmt::Debug {
    /// Claim `claim`'s allocation; `Ok(None)` when no such claim exists (deleted, or made
    /// again with another UID).
    async fn get(&self, claim: &ClaimRef) -> Result<Option<ClaimAllocation>, String>;
}

#[cfg(test)]
mod tests;
