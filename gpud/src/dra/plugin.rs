//! The kubelet's `DRAPlugin` service: prepare a claim by making its exact reservation,
//! unprepare it by ending that reservation. Every claim asked for gets an entry in the
//! answer, its error there when it failed; the call itself fails only when its request is
//! malformed.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::claims::{exact_request, reservation_id};
use super::{ClaimAllocation, ClaimRef, Claims, DRIVER};
use crate::broker::{AllocateRequest, Broker, Caller};
use crate::proto::dra_v1::dra_plugin_server::DraPlugin;
use crate::proto::dra_v1::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse,
};

/// The DRA plugin of one node.
#[derive(Debug, Clone)]
pub struct Plugin {
    broker: Arc<Broker>,
    claims: Arc<dyn Claims>,
    /// This node's pool: the node's name.
    pool: String,
    /// Who owns the reservations made for claims: gpud itself.
    caller: Caller,
}

impl Plugin {
    /// The plugin of the node whose pool is `pool`, reading claims from `claims`.
    pub fn new(broker: Arc<Broker>, claims: Arc<dyn Claims>, pool: String) -> Plugin {
        Plugin {
            broker,
            claims,
            pool,
            caller: Caller {
                uid: 0,
                gid: 0,
                pid: None,
            },
        }
    }

    /// The broker the plugin reserves through.
    pub(super) fn broker(&self) -> &Arc<Broker> {
        &self.broker
    }

    /// This node's pool.
    pub(super) fn pool(&self) -> &str {
        &self.pool
    }

    /// Reads `claim`'s allocation from the API server (the call bounded by the source), or
    /// why it cannot be prepared.
    async fn read(&self, claim: &ClaimRef) -> Result<ClaimAllocation, String> {
        if !self.broker.settings().config.cdi.enabled {
            return Err(format!(
                "gpud's DRA driver needs [cdi] enabled = true: a claim's container gets its \
                 environment and its memory limit through the reservation's CDI device \
                 (claim {}/{})",
                claim.namespace, claim.name
            ));
        }
        let allocation = self
            .claims
            .get(claim)
            .await
            .map_err(|e| {
                format!(
                    "cannot read ResourceClaim {}/{}: {e}",
                    claim.namespace, claim.name
                )
            })?
            .ok_or_else(|| {
                format!(
                    "ResourceClaim {}/{} with UID {} does not exist (deleted, or made again)",
                    claim.namespace, claim.name, claim.uid
                )
            })?;
        Ok(allocation)
    }

    /// Prepares `claim`, allocated `allocation`: its reservation (made now, or already),
    /// and the devices to answer.
    async fn prepare(
        &self,
        claim: &ClaimRef,
        allocation: &ClaimAllocation,
    ) -> Result<Vec<Device>, String> {
        let id = reservation_id(&claim.uid);
        let snapshot = self.broker.snapshot();
        let request = exact_request(allocation, &self.pool, &snapshot.units)?;
        if snapshot.reservation(&id).is_none() {
            let request = AllocateRequest {
                end: Vec::new(),
                containers: vec![request],
            };
            let made = self.broker.allocate(self.caller, request).await;
            // A Prepare of the same claim that ran meanwhile made it: the same answer.
            if let Err(e) = made
                && self.broker.snapshot().reservation(&id).is_none()
            {
                return Err(format!(
                    "gpud could not reserve what the scheduler allocated to claim {}/{}: {e}",
                    claim.namespace, claim.name
                ));
            }
            tracing::info!(reservation = %id, claim = %format!("{}/{}", claim.namespace, claim.name), "claim prepared");
        }
        Ok(answer(allocation, &id))
    }

    /// Unprepares `claim`: ends its reservation, if it is active.
    async fn unprepare(&self, claim: &ClaimRef) -> Result<(), String> {
        let id = reservation_id(&claim.uid);
        if self.broker.snapshot().reservation(&id).is_none() {
            return Ok(());
        }
        let reason = format!("claim {}/{} unprepared", claim.namespace, claim.name);
        self.broker
            .end(id, reason)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// The devices to answer for `allocation`, whose reservation is `id`: every device of this
/// driver, each naming the reservation's CDI device (the kubelet hands a container the CDI
/// devices of the devices whose request it references), under the request a container
/// references: a `firstAvailable` subrequest's device (`gpu/small`) under its request (`gpu`).
fn answer(allocation: &ClaimAllocation, id: &str) -> Vec<Device> {
    allocation
        .devices
        .iter()
        .filter(|d| d.driver == DRIVER)
        .map(|d| Device {
            request_names: vec![request_name(&d.request).to_owned()],
            pool_name: d.pool.clone(),
            device_name: d.device.clone(),
            cdi_device_ids: vec![crate::cdi::device_name(id)],
        })
        .collect()
}

/// The request a container references for an allocation result's `request`: the request
/// itself, or the request a `firstAvailable` subrequest (`<request>/<subrequest>`) is of.
fn request_name(request: &str) -> &str {
    request.split_once('/').map_or(request, |(r, _)| r)
}

/// The claim a kubelet request names, or why it is malformed.
fn claim_ref(c: Claim) -> Result<ClaimRef, Status> {
    if c.uid.is_empty() || c.name.is_empty() || c.namespace.is_empty() {
        return Err(Status::invalid_argument(format!(
            "a claim needs its namespace, name and UID; got {:?}/{:?} UID {:?}",
            c.namespace, c.name, c.uid
        )));
    }
    Ok(ClaimRef {
        namespace: c.namespace,
        name: c.name,
        uid: c.uid,
    })
}

/// The claims a kubelet request names, or why one is malformed.
fn claim_refs(claims: Vec<Claim>) -> Result<Vec<ClaimRef>, Status> {
    claims.into_iter().map(claim_ref).collect()
}

#[tonic::async_trait]
impl DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let claims = claim_refs(request.into_inner().claims)?;
        // The reads at once (each is bounded, so the whole is one bound, not their sum);
        // then the reservations in the kubelet's order, so that what fits is the same
        // whichever read answered first.
        let mut reads = tokio::task::JoinSet::new();
        for (i, claim) in claims.iter().enumerate() {
            let (plugin, claim) = (self.clone(), claim.clone());
            reads.spawn(async move { (i, plugin.read(&claim).await) });
        }
        let mut read: Vec<Option<Result<ClaimAllocation, String>>> = vec![None; claims.len()];
        while let Some(done) = reads.join_next().await {
            if let Ok((i, result)) = done
                && let Some(slot) = read.get_mut(i)
            {
                *slot = Some(result);
            }
        }
        let mut answers = HashMap::new();
        for (claim, allocation) in claims.into_iter().zip(read) {
            let result = match allocation {
                Some(Ok(allocation)) => self.prepare(&claim, &allocation).await,
                Some(Err(e)) => Err(e),
                None => Err(
                    "gpud failed while reading this claim; the kubelet will ask again".to_owned(),
                ),
            };
            let answer = match result {
                Ok(devices) => NodePrepareResourceResponse {
                    devices,
                    error: String::new(),
                },
                Err(error) => {
                    tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), %error, "claim not prepared");
                    NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    }
                }
            };
            answers.insert(claim.uid, answer);
        }
        Ok(Response::new(NodePrepareResourcesResponse {
            claims: answers,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let claims = claim_refs(request.into_inner().claims)?;
        let mut answers = HashMap::new();
        for claim in claims {
            let error = self.unprepare(&claim).await.err().unwrap_or_default();
            answers.insert(claim.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(NodeUnprepareResourcesResponse {
            claims: answers,
        }))
    }
}

/// A message of one API version as the same message of another: v1 and v1beta1 share their
/// messages field for field, so the bytes of one are the other.
fn same<A: prost::Message, B: prost::Message + Default>(a: &A) -> Result<B, Status> {
    B::decode(a.encode_to_vec().as_slice())
        .map_err(|e| Status::internal(format!("v1 and v1beta1 messages differ: {e}")))
}

/// The v1beta1 service: the v1 one, its messages carried across.
#[tonic::async_trait]
impl crate::proto::dra_v1beta1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        request: Request<crate::proto::dra_v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<crate::proto::dra_v1beta1::NodePrepareResourcesResponse>, Status> {
        let request = Request::new(same(request.get_ref())?);
        let answer = DraPlugin::node_prepare_resources(self, request).await?;
        Ok(Response::new(same(answer.get_ref())?))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<crate::proto::dra_v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<crate::proto::dra_v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let request = Request::new(same(request.get_ref())?);
        let answer = DraPlugin::node_unprepare_resources(self, request).await?;
        Ok(Response::new(same(answer.get_ref())?))
    }
}
