# frozen_string_literal: true

# Certificates for the Vagrant testbed, made on the host by Vagrant's own Ruby
# (its openssl library: nothing to install on the host), once, before the
# first VM boots; every VM gets them through the synced folder
# (/opt/mmmesh-testbed/vagrant/pki) and vagrant/provision.sh copies its own.
#
#   pki/ca.pem                      the mesh CA (peers.ca_file on every node)
#   pki/<node>.pem, <node>.key      the node's peer certificate: URI SAN
#                                   spiffe://mmmesh/node/<node>, DNS SAN and CN
#                                   <node>, serverAuth + clientAuth, ECDSA P-256
#                                   (what `mmmeshctl cluster certs` makes)
#   pki/etcd/ca.pem                 a second CA, for etcd alone
#   pki/etcd/<node>-server.pem/.key etcd's serving and peer certificate on that
#                                   node (DNS <node>, localhost; IP <ip>, 127.0.0.1)
#   pki/etcd/<node>-client.pem/.key qosd's etcd client certificate (CN <node>)
#   pki/api-token                   the bearer token of the nodes' admin API over TCP
#                                   (api_tcp on the private address, port 8470)
#   pki/nodes                       the "name ip" list they were made for
#
# The CA keys are never written: nothing can issue another certificate for
# this mesh afterwards.  To change the nodes (nodes.conf), delete pki/ and run
# `vagrant provision` (it makes a new set, every node picks it up).
#
# Command line (what tests/system/vagrant/test_vagrant.py runs):  ruby pki.rb OUT_DIR NODES_CONF

require "fileutils"
require "openssl"
require "securerandom"

module MmmeshPki
  TRUST_DOMAIN = "mmmesh"
  DAYS = 365

  # [[name, ip, role], ...] from nodes.conf (comments and blank lines skipped)
  def self.read_nodes(path)
    File.readlines(path).map { |l| l.sub(/#.*/, "").split }.reject(&:empty?).map do |f|
      raise ArgumentError, "#{path}: want 'name ip role', got #{f.join(' ')}" unless f.size == 3

      f
    end
  end

  def self.key
    OpenSSL::PKey::EC.generate("prime256v1")
  end

  def self.key_pem(key)
    key.respond_to?(:private_to_pem) ? key.private_to_pem : key.to_pem # PKCS#8 where possible
  end

  # One certificate.  issuer: [cert, key], nil for a self-signed CA.
  def self.cert(cn, key, issuer, ca: false, san: nil, eku: nil)
    c = OpenSSL::X509::Certificate.new
    c.version = 2
    c.serial = OpenSSL::BN.new(SecureRandom.hex(16), 16)
    c.subject = OpenSSL::X509::Name.new([["CN", cn]])
    c.issuer = issuer ? issuer[0].subject : c.subject
    c.public_key = key
    c.not_before = Time.now - 300
    c.not_after = Time.now + DAYS * 86_400
    ef = OpenSSL::X509::ExtensionFactory.new
    ef.subject_certificate = c
    ef.issuer_certificate = issuer ? issuer[0] : c
    constraints = ca ? "CA:TRUE,pathlen:0" : "CA:FALSE"
    usage = ca ? "digitalSignature,keyCertSign,cRLSign" : "digitalSignature"
    c.add_extension(ef.create_extension("basicConstraints", constraints, true))
    c.add_extension(ef.create_extension("keyUsage", usage, true))
    c.add_extension(ef.create_extension("subjectKeyIdentifier", "hash", false))
    c.add_extension(ef.create_extension("authorityKeyIdentifier", "keyid:always", false)) if issuer
    c.add_extension(ef.create_extension("extendedKeyUsage", eku, false)) if eku
    c.add_extension(ef.create_extension("subjectAltName", san, false)) if san
    c.sign(issuer ? issuer[1] : key, OpenSSL::Digest.new("SHA256"))
    c
  end

  def self.write(path, data, mode)
    File.open(path, File::WRONLY | File::CREAT | File::TRUNC, mode) { |f| f.write(data) }
    File.chmod(mode, path)
  end

  def self.issue(dir, nodes)
    FileUtils.mkdir_p(File.join(dir, "etcd"))
    ca_key = key
    ca = cert("mmmesh vagrant CA", ca_key, nil, ca: true)
    write(File.join(dir, "ca.pem"), ca.to_pem, 0o644)
    etcd_ca_key = key
    etcd_ca = cert("mmmesh vagrant etcd CA", etcd_ca_key, nil, ca: true)
    write(File.join(dir, "etcd", "ca.pem"), etcd_ca.to_pem, 0o644)
    nodes.each do |name, ip, _role|
      k = key
      c = cert(name, k, [ca, ca_key], san: "URI:spiffe://#{TRUST_DOMAIN}/node/#{name},DNS:#{name}",
                                      eku: "serverAuth,clientAuth")
      write(File.join(dir, "#{name}.pem"), c.to_pem, 0o644)
      write(File.join(dir, "#{name}.key"), key_pem(k), 0o600)
      k = key
      c = cert(name, k, [etcd_ca, etcd_ca_key],
               san: "DNS:#{name},DNS:localhost,IP:#{ip},IP:127.0.0.1", eku: "serverAuth,clientAuth")
      write(File.join(dir, "etcd", "#{name}-server.pem"), c.to_pem, 0o644)
      write(File.join(dir, "etcd", "#{name}-server.key"), key_pem(k), 0o600)
      k = key
      c = cert(name, k, [etcd_ca, etcd_ca_key], eku: "clientAuth")
      write(File.join(dir, "etcd", "#{name}-client.pem"), c.to_pem, 0o644)
      write(File.join(dir, "etcd", "#{name}-client.key"), key_pem(k), 0o600)
    end
    write_token(dir)
    write(File.join(dir, "nodes"), nodes.map { |n, ip, _| "#{n} #{ip}\n" }.join, 0o644)
  end

  # the bearer token of every node's admin API over TCP (api_tcp on the private
  # address): mmmeshctl --server http://<ip>:8470 --token "$(cat pki/api-token)"
  def self.write_token(dir)
    write(File.join(dir, "api-token"), "#{SecureRandom.hex(24)}\n", 0o600)
  end

  # Makes dir (atomically: built beside it, then renamed) unless it is there
  # for the same nodes; refuses a dir made for other nodes.  Safe to call from
  # several threads or processes at once (vagrant-libvirt brings VMs up in
  # parallel): a lock file beside dir.
  def self.ensure(dir, nodes_conf)
    nodes = read_nodes(nodes_conf)
    want = nodes.map { |n, ip, _| "#{n} #{ip}\n" }.join
    FileUtils.mkdir_p(File.dirname(dir))
    File.open("#{dir}.lock", File::RDWR | File::CREAT, 0o644) do |lock|
      lock.flock(File::LOCK_EX)
      stamp = File.join(dir, "nodes")
      if File.exist?(stamp)
        if File.read(stamp) == want
          # a set made before the API token existed gets one (nothing else changes)
          return false if File.exist?(File.join(dir, "api-token"))

          write_token(dir)
          return true
        end

        raise "#{dir} was made for other nodes than #{nodes_conf}: delete it and run " \
              "`vagrant provision` (every node gets the new certificates)"
      end
      tmp = "#{dir}.tmp-#{Process.pid}"
      FileUtils.rm_rf(tmp)
      issue(tmp, nodes)
      FileUtils.rm_rf(dir)
      File.rename(tmp, dir)
      true
    end
  end
end

if $PROGRAM_NAME == __FILE__
  abort "usage: ruby #{$PROGRAM_NAME} OUT_DIR NODES_CONF" unless ARGV.size == 2
  made = MmmeshPki.ensure(ARGV[0], ARGV[1])
  puts(made ? "made #{ARGV[0]}" : "#{ARGV[0]} is up to date")
end
