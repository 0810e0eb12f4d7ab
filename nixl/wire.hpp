// SPDX-License-Identifier: MIT
// The control channel between two KVSTAGE NIXL backends: the peer secret, the
// key, the handshake and the authenticated frames (docs/nixl.md, "The control
// channel"). No NIXL header here: this part is plain C++ over libsodium.
#ifndef KVS_NIXL_WIRE_HPP
#define KVS_NIXL_WIRE_HPP

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <sodium.h>

namespace kvsnixl {

constexpr size_t kNonce = 16;
constexpr size_t kMac = 32;
constexpr size_t kKey = 32;
constexpr size_t kSecretMin = 16, kSecretMax = 4096;
constexpr char kMagic[8] = {'K', 'V', 'S', 'N', 'I', 'X', 'L', '1'};
constexpr char kKeyLabel[] = "kvstage nixl v1";
// A frame's body is at most this (its length field says more: the connection is dropped).
constexpr uint32_t kMaxBody = 1u << 20;

// Reads the deployment's peer secret: the file at path if it is not empty, else
// $KVSTAGE_PEER_SECRET_FILE, else $KVSTAGE_PEER_SECRET. The file is judged as
// kvstage.sidechannel judges it (a regular file of ours or root's, nobody
// else may read or write it, 16 to 4096 bytes after one trailing newline).
// Returns true and the secret, or false and why in err.
bool load_secret(const std::string &path, std::string &secret, std::string &err);

// key = HMAC-SHA256(secret, "kvstage nixl v1").
void derive_key(const std::string &secret, uint8_t key[kKey]);

// HMAC-SHA256(key, parts...).
struct Mac {
	explicit Mac(const uint8_t key[kKey]);
	Mac &add(const void *p, size_t n);
	void done(uint8_t out[kMac]);

      private:
	crypto_auth_hmacsha256_state st_;
};
bool mac_equal(const uint8_t a[kMac], const uint8_t b[kMac]);
void random_bytes(void *p, size_t n);

// The proofs of the handshake: the listener's over (cn, sn), then the dialer's.
void listener_proof(const uint8_t key[kKey], const uint8_t cn[kNonce], const uint8_t sn[kNonce],
		    uint8_t out[kMac]);
void dialer_proof(const uint8_t key[kKey], const uint8_t cn[kNonce], const uint8_t sn[kNonce],
		  uint8_t out[kMac]);
// A frame's MAC: dir is 'd' (dialer to listener) or 'l' (listener to dialer).
void frame_mac(const uint8_t key[kKey], char dir, const uint8_t cn[kNonce],
	       const uint8_t sn[kNonce], uint64_t seq, const uint8_t *hdr_body, size_t n,
	       uint8_t out[kMac]);

// Message types (the body's first byte).
enum : uint8_t {
	MSG_REQ = 1,	// initiator -> target: a READ or WRITE request (descriptors follow)
	MSG_DESCS = 2,	// initiator -> target: a batch of the request's target descriptors
	MSG_ROOM = 3,	// a room descriptor for a segment of a request's bytes
	MSG_DONE = 4,	// target -> initiator: a request ended on the target (status)
	MSG_CANCEL = 5, // initiator -> target: the initiator released the request
	MSG_NOTIF = 6,	// a notification not bound to a transfer (genNotif)
};
enum : uint8_t { OP_READ = 0, OP_WRITE = 1 };

// Little-endian writer/reader of a body.
struct Writer {
	std::vector<uint8_t> b;
	Writer &u8(uint8_t v);
	Writer &u16(uint16_t v);
	Writer &u32(uint32_t v);
	Writer &u64(uint64_t v);
	Writer &bytes(const void *p, size_t n);
	Writer &str16(const std::string &s); // u16 length + bytes
	Writer &str32(const std::string &s); // u32 length + bytes
};
struct Reader {
	const uint8_t *p;
	size_t n;
	bool ok = true;
	Reader(const uint8_t *p_, size_t n_) : p(p_), n(n_)
	{
	}
	uint8_t u8();
	uint16_t u16();
	uint32_t u32();
	uint64_t u64();
	bool bytes(void *out, size_t len);
	bool str16(std::string &s, size_t max);
	bool str32(std::string &s, size_t max);
	bool end() const
	{
		return ok && n == 0;
	}
};

} // namespace kvsnixl
#endif
