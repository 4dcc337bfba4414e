//! Device meshes and DIDx sharding annotations (nvFuser's multi-device vocabulary).
//!
//! A tensor on a mesh of `d` devices is either replicated (every device holds all of it)
//! or sharded along one logical axis: `t.split(axis, d, inner_split=False)` then
//! `t.axis(axis).parallelize(DIDx)` gives device `i` of the mesh the `i`-th of `d` equal
//! slices of that axis. The definition keeps global shapes; `fd.execute` on each rank
//! takes the local slices. These annotations are not a kernel schedule: a sharded fusion
//! stays automatically scheduled, and `host::multidevice` decomposes it into local
//! kernels and collectives.

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, IterDomainId, IterType, TvId};

/// The mesh a tensor lives on and how it is spread over it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TvMesh {
    /// Device ids (process ranks), in mesh order.
    pub devices: Vec<i64>,
    /// The logical axis (reduction axes counted) sharded over DIDx; None: replicated.
    pub axis: Option<usize>,
    /// An outer split by the mesh size that waits for `parallelize(DIDx)`: the split's
    /// outer loop id and the logical axis it splits.
    pub pending: Option<(IterDomainId, usize)>,
}

impl Fusion {
    /// Put `tv` on the mesh `devices` (replicated until an axis is parallelized over DIDx).
    pub fn set_device_mesh(&mut self, tv: TvId, devices: &[i64]) -> Result<()> {
        let name = self.tv_name(tv);
        if devices.is_empty() {
            bail!("set_device_mesh {name}: the mesh has no devices");
        }
        if let Some(&bad) = devices.iter().find(|&&d| d < 0) {
            bail!("set_device_mesh {name}: device {bad} is negative; devices are process ranks from 0");
        }
        let mut seen = devices.to_vec();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            bail!("set_device_mesh {name}: device {} is listed twice in {devices:?}", w[0]);
        }
        if let Some(old) = self.meshes.get(&tv) {
            if (old.axis.is_some() || old.pending.is_some()) && old.devices.len() != devices.len() {
                bail!(
                    "set_device_mesh {name}: the tensor is split over its mesh of {} devices; a mesh of {} would drop that sharding (define the tensor again to shard it over another mesh)",
                    old.devices.len(),
                    devices.len()
                );
            }
        }
        let keep = self.meshes.get(&tv).and_then(|m| m.axis);
        let pending = self.meshes.get(&tv).and_then(|m| m.pending);
        self.meshes.insert(tv, TvMesh { devices: devices.to_vec(), axis: keep, pending });
        Ok(())
    }

    /// True when some tensor of the fusion was put on a device mesh.
    pub fn has_mesh(&self) -> bool {
        !self.meshes.is_empty()
    }

    /// `split(axis, d, inner_split=False)` of a tensor on a mesh of `d` devices: the outer
    /// part is what `parallelize(DIDx)` spreads over the devices. It does not make the
    /// fusion manually scheduled, and inputs may be split this way.
    pub fn mesh_split(&mut self, tv: TvId, axis: i64, factor: i64) -> Result<()> {
        let name = self.tv_name(tv);
        let Some(mesh) = self.meshes.get(&tv).cloned() else {
            bail!("split {name}: internal: no device mesh");
        };
        let d = mesh.devices.len() as i64;
        if factor != d {
            bail!(
                "split {name}: an outer split (inner_split=False) of a tensor on a mesh of {d} device(s) shards it, so its factor must be {d}, got {factor}"
            );
        }
        if mesh.axis.is_some() || mesh.pending.is_some() {
            bail!("split {name}: the tensor is already split over its mesh; shard one axis per tensor");
        }
        let a = self.normalize_axis(tv, axis)?;
        let id = self.tvs[tv].loop_domain[a];
        let Some(lpos) = self.tvs[tv].logical.iter().position(|&l| l == id) else {
            bail!("split {name}: axis {a} is not a logical axis; shard a tensor before any other transform of it");
        };
        if self.ids[id].iter_type == IterType::Broadcast {
            bail!("split {name}: axis {a} is a broadcast axis; only an axis with data can be sharded");
        }
        let was = self.manually_scheduled;
        let before = self.tvs[tv].loop_domain.len();
        self.split(tv, a as i64, factor, false)?;
        self.manually_scheduled = was;
        debug_assert_eq!(self.tvs[tv].loop_domain.len(), before + 1);
        let outer = self.tvs[tv].loop_domain[a];
        if let Some(m) = self.meshes.get_mut(&tv) {
            m.pending = Some((outer, lpos));
        }
        Ok(())
    }

    /// `parallelize(DIDx)` of loop axis `axis`: the outer part of a mesh split, or a
    /// logical axis itself (each device then holds 1/d of it all the same).
    pub fn shard_axis(&mut self, tv: TvId, axis: i64) -> Result<()> {
        let name = self.tv_name(tv);
        let Some(mesh) = self.meshes.get(&tv).cloned() else {
            bail!("parallelize {name}: DIDx needs a device mesh; call {name}.set_device_mesh(mesh) first");
        };
        let a = self.normalize_axis(tv, axis)?;
        let id = self.tvs[tv].loop_domain[a];
        let lpos = match mesh.pending {
            Some((outer, lpos)) if outer == id => lpos,
            _ => match self.tvs[tv].logical.iter().position(|&l| l == id) {
                Some(p) if self.ids[id].iter_type != IterType::Broadcast => p,
                _ => bail!(
                    "parallelize {name}: axis {a} is neither a logical axis nor the outer part of a split by the mesh size (split(axis, {}, inner_split=False)); it cannot be DIDx",
                    mesh.devices.len()
                ),
            },
        };
        if let Some(prev) = mesh.axis {
            if prev != lpos {
                bail!("parallelize {name}: DIDx is already used by logical axis {prev}; each tensor may use it once");
            }
        }
        if let Some(m) = self.meshes.get_mut(&tv) {
            m.axis = Some(lpos);
            m.pending = None;
        }
        Ok(())
    }

    /// The loop id a DIDx annotation sits on, for printing (`parallel_type` of that axis).
    pub fn is_device_parallel(&self, tv: TvId, id: IterDomainId) -> bool {
        let Some(m) = self.meshes.get(&tv) else { return false };
        let Some(axis) = m.axis else { return false };
        if self.tvs[tv].logical.get(axis) == Some(&id) {
            return true;
        }
        // The outer part of the mesh split of that logical axis.
        self.tvs[tv].loop_domain.contains(&id)
            && self.ids[id].definition.is_some_and(|t| {
                matches!(self.transforms[t], crate::ir::Transform::Split { input, outer, inner_split: false, .. }
                    if outer == id && input == self.tvs[tv].logical[axis])
            })
    }
}
