//! Partition tables: GPT (its header's CRC checked, entries bounded) and
//! MBR (told apart from a filesystem's boot sector by its boot flags).

use serde::Serialize;

use super::{bytes, guid, le32, le64};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TableType {
    Gpt,
    Mbr,
}

/// One partition as the table describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionEntry {
    /// 1-based, as the kernel numbers partitions.
    pub number: u32,
    pub start_lba: u64,
    pub sectors: u64,
    /// GPT: the type GUID; MBR: the type byte as `0x83`.
    pub type_id: String,
    /// GPT only: the partition's unique GUID (blkid's PARTUUID).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionTable {
    #[serde(rename = "type")]
    pub table: TableType,
    /// GPT: the disk GUID; MBR: the 32-bit disk signature in hex.
    pub id: String,
    pub partitions: Vec<PartitionEntry>,
}

/// Most entries a GPT may declare before the probe calls it hostile; real
/// tables have 128.
const GPT_MAX_ENTRIES: u32 = 4096;

pub(super) fn gpt(buf: &[u8], lb: u32) -> Option<PartitionTable> {
    if !matches!(lb, 512 | 1024 | 2048 | 4096) {
        return None;
    }
    let h = lb as usize;
    if buf.get(h..h + 8)? != b"EFI PART" {
        return None;
    }
    let header_size = le32(buf, h + 12)? as usize;
    if !(92..=lb as usize).contains(&header_size) {
        return None;
    }
    let mut header = buf.get(h..h + header_size)?.to_vec();
    let crc = le32(&header, 16)?;
    header[16..20].fill(0);
    if crc32fast::hash(&header) != crc || le64(buf, h + 24)? != 1 {
        return None;
    }
    let entries_lba = le64(buf, h + 72)?;
    let count = le32(buf, h + 80)?;
    let entry_size = le32(buf, h + 84)? as usize;
    if count > GPT_MAX_ENTRIES || !(128..=4096).contains(&entry_size) || !entry_size.is_multiple_of(8) {
        return None;
    }
    let mut partitions = Vec::new();
    // Entries beyond what was read are left out rather than guessed.
    let start = usize::try_from(entries_lba).ok().and_then(|l| l.checked_mul(h));
    if let Some(start) = start {
        for i in 0..count as usize {
            let at = start + i * entry_size;
            let Some(e) = buf.get(at..at + entry_size) else { break };
            let type_guid: [u8; 16] = e[0..16].try_into().ok()?;
            if type_guid == [0; 16] {
                continue;
            }
            let first = le64(e, 32)?;
            let last = le64(e, 40)?;
            let name: Vec<u16> = e[56..128].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).take_while(|&u| u != 0).collect();
            let name = String::from_utf16_lossy(&name);
            partitions.push(PartitionEntry {
                number: i as u32 + 1,
                start_lba: first,
                sectors: last.saturating_sub(first).saturating_add(1),
                type_id: guid(type_guid)?,
                uuid: guid(e[16..32].try_into().ok()?),
                name: (!name.is_empty()).then_some(name),
            });
        }
    }
    Some(PartitionTable { table: TableType::Gpt, id: guid(bytes(buf, h + 56)?).unwrap_or_default(), partitions })
}

pub(super) fn mbr(buf: &[u8]) -> Option<PartitionTable> {
    if buf.get(510..512)? != [0x55, 0xAA] {
        return None;
    }
    let mut partitions = Vec::new();
    for i in 0..4 {
        let e = buf.get(446 + i * 16..446 + (i + 1) * 16)?;
        // A boot flag other than 0x00/0x80 means this is a boot sector of a
        // filesystem (FAT), not a partition table.
        if e[0] != 0 && e[0] != 0x80 {
            return None;
        }
        let kind = e[4];
        let sectors = u64::from(le32(e, 12)?);
        if kind == 0 || sectors == 0 {
            continue;
        }
        partitions.push(PartitionEntry {
            number: i as u32 + 1,
            start_lba: u64::from(le32(e, 8)?),
            sectors,
            type_id: format!("0x{kind:02x}"),
            uuid: None,
            name: None,
        });
    }
    // A protective MBR whose GPT did not verify is not an MBR table either.
    if partitions.iter().any(|p| p.type_id == "0xee") {
        return None;
    }
    Some(PartitionTable { table: TableType::Mbr, id: format!("{:08x}", le32(buf, 440)?), partitions })
}
