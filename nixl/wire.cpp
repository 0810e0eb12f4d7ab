// SPDX-License-Identifier: MIT
#include "wire.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

namespace kvsnixl {

namespace {

std::string strip_one_newline(std::string s)
{
	if (s.size() >= 2 && s.compare(s.size() - 2, 2, "\r\n") == 0)
		s.resize(s.size() - 2);
	else if (!s.empty() && s.back() == '\n')
		s.pop_back();
	return s;
}

// The rule of kvstaged (proxy/peer/secret.c) and kvstage.sidechannel: a POSIX ACL
// on the file may name only its owner and our uid. Returns 1 if it has one that
// lets only us in, 0 if it has none, -1 (err set) if it lets someone else in.
int acl_lets_only_us(int fd, const std::string &path, std::string &err)
{
	uint8_t x[1024];
	ssize_t n = fgetxattr(fd, "system.posix_acl_access", x, sizeof(x));
	if (n < 0)
		return 0;
	uint32_t ver;
	if (n < 4 || (n - 4) % 8 || (memcpy(&ver, x, 4), ver != 2)) {
		err = "peer secret file " + path +
		      ": an ACL this reader cannot parse; chmod 600 it and drop the ACL (setfacl -b)";
		return -1;
	}
	for (ssize_t off = 4; off < n; off += 8) {
		uint16_t tag, perm;
		uint32_t id;
		memcpy(&tag, x + off, 2);
		memcpy(&perm, x + off + 2, 2);
		memcpy(&id, x + off + 4, 4);
		if (!(perm & 7))
			continue;
		if (tag == 0x02 && id != geteuid()) {
			err = "peer secret file " + path + ": its ACL lets uid " + std::to_string(id) +
			      " in; only ours may be named";
			return -1;
		}
		if (tag == 0x04 || tag == 0x08 || tag == 0x20) {
			err = "peer secret file " + path +
			      ": its ACL lets others in; chmod 600 it and drop the ACL (setfacl -b)";
			return -1;
		}
	}
	return 1;
}

bool read_secret_file(const std::string &path, std::string &secret, std::string &err)
{
	int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		err = "peer secret file " + path + ": " + strerror(errno);
		return false;
	}
	struct stat st;
	std::string raw;
	bool ok = false;
	if (fstat(fd, &st) < 0) {
		err = "peer secret file " + path + ": " + strerror(errno);
	} else if (!S_ISREG(st.st_mode)) {
		err = "peer secret file " + path + ": not a regular file";
	} else if (st.st_uid != geteuid() && st.st_uid != 0) {
		err = "peer secret file " + path + ": owned by uid " + std::to_string(st.st_uid) +
		      "; it must be ours or root's";
	} else if ((st.st_mode & 007) ||
		   ((st.st_mode & 070) && acl_lets_only_us(fd, path, err) != 1)) {
		if (err.empty())
			err = "peer secret file " + path +
			      ": its group or others can read or write it; chmod 600 it";
	} else if (st.st_size > (off_t)kSecretMax + 2) {
		err = "peer secret file " + path + ": " + std::to_string(st.st_size) +
		      " bytes; a secret is 16 to 4096 bytes";
	} else {
		char buf[kSecretMax + 3];
		size_t got = 0;
		for (;;) {
			ssize_t r = read(fd, buf + got, sizeof(buf) - got);
			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0)
				break;
			got += (size_t)r;
			if (got == sizeof(buf))
				break;
		}
		raw.assign(buf, got);
		ok = true;
	}
	close(fd);
	if (!ok)
		return false;
	secret = strip_one_newline(raw);
	if (secret.size() < kSecretMin || secret.size() > kSecretMax) {
		err = "peer secret file " + path + ": " + std::to_string(secret.size()) +
		      " bytes; a secret is 16 to 4096 bytes";
		return false;
	}
	return true;
}

} // namespace

bool load_secret(const std::string &path_in, std::string &secret, std::string &err)
{
	std::string path = path_in;
	if (path.empty()) {
		const char *e = getenv("KVSTAGE_PEER_SECRET_FILE");
		if (e && *e)
			path = e;
	}
	if (!path.empty())
		return read_secret_file(path, secret, err);
	const char *v = getenv("KVSTAGE_PEER_SECRET");
	if (v && *v) {
		secret = v;
		if (secret.size() < kSecretMin || secret.size() > kSecretMax) {
			err = "$KVSTAGE_PEER_SECRET is " + std::to_string(secret.size()) +
			      " bytes; a secret is 16 to 4096 bytes";
			return false;
		}
		return true;
	}
	err = "no peer secret: set the backend parameter peer_secret_file, or "
	      "KVSTAGE_PEER_SECRET_FILE to a file only this user can read (16-4096 bytes; the "
	      "deployment's peer secret, as kvstaged's --peer-secret-file), or KVSTAGE_PEER_SECRET";
	return false;
}

Mac::Mac(const uint8_t key[kKey])
{
	crypto_auth_hmacsha256_init(&st_, key, kKey);
}

Mac &Mac::add(const void *p, size_t n)
{
	crypto_auth_hmacsha256_update(&st_, (const unsigned char *)p, n);
	return *this;
}

void Mac::done(uint8_t out[kMac])
{
	crypto_auth_hmacsha256_final(&st_, out);
}

bool mac_equal(const uint8_t a[kMac], const uint8_t b[kMac])
{
	return sodium_memcmp(a, b, kMac) == 0;
}

void random_bytes(void *p, size_t n)
{
	randombytes_buf(p, n);
}

void derive_key(const std::string &secret, uint8_t key[kKey])
{
	crypto_auth_hmacsha256_state st;
	crypto_auth_hmacsha256_init(&st, (const unsigned char *)secret.data(), secret.size());
	crypto_auth_hmacsha256_update(&st, (const unsigned char *)kKeyLabel, strlen(kKeyLabel));
	crypto_auth_hmacsha256_final(&st, key);
}

void listener_proof(const uint8_t key[kKey], const uint8_t cn[kNonce], const uint8_t sn[kNonce],
		    uint8_t out[kMac])
{
	Mac(key).add("L", 1).add(cn, kNonce).add(sn, kNonce).done(out);
}

void dialer_proof(const uint8_t key[kKey], const uint8_t cn[kNonce], const uint8_t sn[kNonce],
		  uint8_t out[kMac])
{
	Mac(key).add("D", 1).add(cn, kNonce).add(sn, kNonce).done(out);
}

void frame_mac(const uint8_t key[kKey], char dir, const uint8_t cn[kNonce],
	       const uint8_t sn[kNonce], uint64_t seq, const uint8_t *hdr_body, size_t n,
	       uint8_t out[kMac])
{
	uint8_t s[8];
	for (int i = 0; i < 8; i++)
		s[i] = (uint8_t)(seq >> (56 - 8 * i));
	Mac(key).add(&dir, 1).add(cn, kNonce).add(sn, kNonce).add(s, 8).add(hdr_body, n).done(out);
}

Writer &Writer::u8(uint8_t v)
{
	b.push_back(v);
	return *this;
}
Writer &Writer::u16(uint16_t v)
{
	for (int i = 0; i < 2; i++)
		b.push_back((uint8_t)(v >> (8 * i)));
	return *this;
}
Writer &Writer::u32(uint32_t v)
{
	for (int i = 0; i < 4; i++)
		b.push_back((uint8_t)(v >> (8 * i)));
	return *this;
}
Writer &Writer::u64(uint64_t v)
{
	for (int i = 0; i < 8; i++)
		b.push_back((uint8_t)(v >> (8 * i)));
	return *this;
}
Writer &Writer::bytes(const void *p, size_t n)
{
	b.insert(b.end(), (const uint8_t *)p, (const uint8_t *)p + n);
	return *this;
}
Writer &Writer::str16(const std::string &s)
{
	return u16((uint16_t)s.size()).bytes(s.data(), s.size());
}
Writer &Writer::str32(const std::string &s)
{
	return u32((uint32_t)s.size()).bytes(s.data(), s.size());
}

uint8_t Reader::u8()
{
	if (n < 1) {
		ok = false;
		return 0;
	}
	n--;
	return *p++;
}
// n little-endian bytes as an integer; short input clears ok and reads 0.
static uint64_t take_le(Reader &r, size_t n)
{
	if (r.n < n) {
		r.ok = false;
		return 0;
	}
	uint64_t v = 0;
	for (size_t i = n; i-- > 0;)
		v = v << 8 | r.p[i];
	r.p += n;
	r.n -= n;
	return v;
}
uint16_t Reader::u16()
{
	return (uint16_t)take_le(*this, 2);
}
uint32_t Reader::u32()
{
	return (uint32_t)take_le(*this, 4);
}
uint64_t Reader::u64()
{
	return take_le(*this, 8);
}
bool Reader::bytes(void *out, size_t len)
{
	if (n < len) {
		ok = false;
		return false;
	}
	memcpy(out, p, len);
	p += len;
	n -= len;
	return true;
}
bool Reader::str16(std::string &s, size_t max)
{
	uint16_t len = u16();
	if (!ok || len > max || n < len) {
		ok = false;
		return false;
	}
	s.assign((const char *)p, len);
	p += len;
	n -= len;
	return true;
}
bool Reader::str32(std::string &s, size_t max)
{
	uint32_t len = u32();
	if (!ok || len > max || n < len) {
		ok = false;
		return false;
	}
	s.assign((const char *)p, len);
	p += len;
	n -= len;
	return true;
}

} // namespace kvsnixl
