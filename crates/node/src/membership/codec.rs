//! The SWIM messages' encoding, by hand: `foca` leaves its codec to its
//! user, and a fixed binary layout of a few fields needs no serde format.
//! Every read is bounds-checked: a packet that does not parse is an error
//! (counted by the caller), never a panic.
//!
//! An identity is `name length (1 byte), name, IPv4 (4), port (2), run (8),
//! renewal (2)`; a member is an identity, its incarnation (2) and its state
//! (1); a header is the sender's identity and incarnation, the destination
//! identity and the message (a tag byte and its fields).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use bytes::{Buf, BufMut};
use foca::{Header, Member, Message, State};

use super::identity::Id;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CodecError {
    #[error("the message is cut short")]
    Short,
    #[error("unknown message tag {0}")]
    Tag(u8),
    #[error("unknown member state {0}")]
    State(u8),
    #[error("a member name is 1-253 bytes of UTF-8")]
    Name,
    #[error("no room for the member in this packet")]
    Full,
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Codec;

fn id_len(id: &Id) -> usize {
    1 + id.name.len() + 4 + 2 + 8 + 2
}

fn put_id(buf: &mut impl BufMut, id: &Id) {
    buf.put_u8(id.name.len() as u8);
    buf.put_slice(id.name.as_bytes());
    buf.put_slice(&id.addr.ip().octets());
    buf.put_u16(id.addr.port());
    buf.put_u64(id.run);
    buf.put_u16(id.renewal);
}

fn need(buf: &impl Buf, n: usize) -> Result<(), CodecError> {
    if buf.remaining() < n {
        Err(CodecError::Short)
    } else {
        Ok(())
    }
}

fn get_id(buf: &mut impl Buf) -> Result<Id, CodecError> {
    need(buf, 1)?;
    let len = usize::from(buf.get_u8());
    if len == 0 || len > 253 {
        return Err(CodecError::Name);
    }
    need(buf, len + 4 + 2 + 8 + 2)?;
    let mut name = vec![0; len];
    buf.copy_to_slice(&mut name);
    let name = String::from_utf8(name).map_err(|_| CodecError::Name)?;
    let mut ip = [0; 4];
    buf.copy_to_slice(&mut ip);
    let port = buf.get_u16();
    Ok(Id {
        name: Arc::from(name),
        addr: SocketAddrV4::new(Ipv4Addr::from(ip), port),
        run: buf.get_u64(),
        renewal: buf.get_u16(),
    })
}

fn state_byte(s: State) -> u8 {
    match s {
        State::Alive => 0,
        State::Suspect => 1,
        State::Down => 2,
    }
}

impl foca::Codec<Id> for Codec {
    type Error = CodecError;

    fn encode_header(&mut self, h: &Header<Id>, mut buf: impl BufMut) -> Result<(), CodecError> {
        put_id(&mut buf, &h.src);
        buf.put_u16(h.src_incarnation);
        put_id(&mut buf, &h.dst);
        let (tag, with) = match &h.message {
            Message::Ping(n) => (0, (None, Some(*n))),
            Message::Ack(n) => (1, (None, Some(*n))),
            Message::PingReq {
                target,
                probe_number,
            } => (2, (Some(target), Some(*probe_number))),
            Message::IndirectPing {
                origin,
                probe_number,
            } => (3, (Some(origin), Some(*probe_number))),
            Message::IndirectAck {
                target,
                probe_number,
            } => (4, (Some(target), Some(*probe_number))),
            Message::ForwardedAck {
                origin,
                probe_number,
            } => (5, (Some(origin), Some(*probe_number))),
            Message::Announce => (6, (None, None)),
            Message::Feed => (7, (None, None)),
            Message::Gossip => (8, (None, None)),
            Message::Broadcast => (9, (None, None)),
            Message::TurnUndead => (10, (None, None)),
        };
        buf.put_u8(tag);
        if let Some(id) = with.0 {
            put_id(&mut buf, id);
        }
        if let Some(n) = with.1 {
            buf.put_u8(n);
        }
        Ok(())
    }

    fn decode_header(&mut self, mut buf: impl Buf) -> Result<Header<Id>, CodecError> {
        let src = get_id(&mut buf)?;
        need(&buf, 2)?;
        let src_incarnation = buf.get_u16();
        let dst = get_id(&mut buf)?;
        need(&buf, 1)?;
        let tag = buf.get_u8();
        let number = |buf: &mut dyn Buf| -> Result<u8, CodecError> {
            need(&buf, 1)?;
            Ok(buf.get_u8())
        };
        let message = match tag {
            0 => Message::Ping(number(&mut buf)?),
            1 => Message::Ack(number(&mut buf)?),
            2..=5 => {
                let id = get_id(&mut buf)?;
                let probe_number = number(&mut buf)?;
                match tag {
                    2 => Message::PingReq {
                        target: id,
                        probe_number,
                    },
                    3 => Message::IndirectPing {
                        origin: id,
                        probe_number,
                    },
                    4 => Message::IndirectAck {
                        target: id,
                        probe_number,
                    },
                    _ => Message::ForwardedAck {
                        origin: id,
                        probe_number,
                    },
                }
            }
            6 => Message::Announce,
            7 => Message::Feed,
            8 => Message::Gossip,
            9 => Message::Broadcast,
            10 => Message::TurnUndead,
            other => return Err(CodecError::Tag(other)),
        };
        Ok(Header {
            src,
            src_incarnation,
            dst,
            message,
        })
    }

    fn encode_member(&mut self, m: &Member<Id>, mut buf: impl BufMut) -> Result<(), CodecError> {
        if buf.remaining_mut() < id_len(m.id()) + 3 {
            return Err(CodecError::Full);
        }
        put_id(&mut buf, m.id());
        buf.put_u16(m.incarnation());
        buf.put_u8(state_byte(m.state()));
        Ok(())
    }

    fn decode_member(&mut self, mut buf: impl Buf) -> Result<Member<Id>, CodecError> {
        let id = get_id(&mut buf)?;
        need(&buf, 3)?;
        let incarnation = buf.get_u16();
        let state = match buf.get_u8() {
            0 => State::Alive,
            1 => State::Suspect,
            2 => State::Down,
            other => return Err(CodecError::State(other)),
        };
        Ok(Member::new(id, incarnation, state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use foca::Codec as _;

    fn id(name: &str) -> Id {
        Id {
            name: Arc::from(name),
            addr: "10.0.0.7:7947".parse().unwrap(),
            run: 1_700_000_000_000,
            renewal: 2,
        }
    }

    #[test]
    fn every_message_survives_the_round_trip() {
        let messages = [
            Message::Ping(1),
            Message::Ack(2),
            Message::PingReq {
                target: id("c"),
                probe_number: 3,
            },
            Message::IndirectPing {
                origin: id("d"),
                probe_number: 4,
            },
            Message::IndirectAck {
                target: id("e"),
                probe_number: 5,
            },
            Message::ForwardedAck {
                origin: id("f"),
                probe_number: 6,
            },
            Message::Announce,
            Message::Feed,
            Message::Gossip,
            Message::Broadcast,
            Message::TurnUndead,
        ];
        for message in messages {
            let h = Header {
                src: id("a"),
                src_incarnation: 9,
                dst: id("b"),
                message,
            };
            let mut buf = Vec::new();
            Codec.encode_header(&h, &mut buf).unwrap();
            assert_eq!(Codec.decode_header(&buf[..]).unwrap(), h);
            // Every cut of it is an error, not a panic.
            for cut in 0..buf.len() {
                assert!(Codec.decode_header(&buf[..cut]).is_err(), "{cut}");
            }
        }
        let m = Member::new(id("g"), 7, State::Suspect);
        let mut buf = Vec::new();
        Codec.encode_member(&m, &mut buf).unwrap();
        assert_eq!(Codec.decode_member(&buf[..]).unwrap(), m);
        let mut small = [0u8; 10];
        assert_eq!(
            Codec.encode_member(&m, &mut small[..]),
            Err(CodecError::Full)
        );
        assert!(
            small.iter().all(|b| *b == 0),
            "a full buffer is left as it was"
        );
    }

    #[test]
    fn garbage_is_an_error() {
        let mut seed = 7u64;
        for _ in 0..2000 {
            let len = (seed % 90) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (seed >> 33) as u8
                })
                .collect();
            let _ = Codec.decode_header(&bytes[..]);
            let _ = Codec.decode_member(&bytes[..]);
        }
    }
}
